"""Model building blocks: tensor-parallel linears and embeddings, norms, paged attention."""
