"""Copy-heavy chat tasks (repeat a paragraph, edit a piece of code): the workload on which
n-gram speculation pays, shared by the speculative-decoding benchmarks and profiles."""

from __future__ import annotations

PARAGRAPH = ("The river rose slowly through the night, and by morning the low fields along "
             "the valley were under water. Farmers moved their animals to the hills, and the "
             "old stone bridge, which had stood for three hundred years, held firm again.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
        "        total += item.price * item.quantity\n    return total * (1 + tax_rate)\n")
COPY_TASKS = [
    f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rename the function total_price to compute_total in this code and show the whole "
    f"code:\n\n{CODE}",
    f"Copy this text and then copy it once more:\n\n{PARAGRAPH}",
    f"Add a docstring to this function and return the full code:\n\n{CODE}",
    f"Rewrite this paragraph with every sentence on its own line:\n\n{PARAGRAPH}",
    f"Change the loop variable item to entry in this code and show the result:\n\n{CODE}",
    f"Repeat the following text twice:\n\n{PARAGRAPH}",
    f"Rename tax_rate to vat in this code and print the whole function:\n\n{CODE}",
]
