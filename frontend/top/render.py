"""One dashboard frame as a rich renderable: a pure function of a TopView, so a frame can be
checked by rendering it to text."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from frontend.engine.stats_log import kv_transfer_text
from frontend.top.state import RequestView, TopView
from protocol.engine_messages import EngineStats

BAR_WIDTH = 30


def render(view: TopView) -> RenderableType:
    return Group(_header(view), _engine(view), _requests(view.requests))


def _header(view: TopView) -> Text:
    text = Text.assemble(("nanopipe top", "bold"), f"  {view.address}  ")
    if view.status == "attached":
        text.append("(q quits)", style="dim")
    else:
        text.append(view.status, style="bold red")
    return text


def _engine(view: TopView) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    s, r = view.stats, view.rates
    if s is None:
        grid.add_row("engine", "waiting for the first stats…")
        return grid
    if r is None:
        grid.add_row("throughput", "measuring…")
    else:
        grid.add_row("throughput", f"{r.generated_tok_s:,.1f} gen tok/s   "
                                   f"{r.prompt_tok_s:,.1f} prompt tok/s")
    grid.add_row("requests", f"running {s.running}   waiting {s.waiting}   "
                             f"finished {s.finished_requests:,}   "
                             f"preemptions {s.preemptions:,}")
    grid.add_row("tokens", f"generated {s.generated_tokens:,}   prompt {s.prompt_tokens:,}   "
                           f"from prefix cache {s.cached_prompt_tokens:,}")
    grid.add_row("KV blocks", kv_bar(s.kv_blocks_used, s.kv_blocks_total))
    hits = "-" if view.prefix_hits_total is None else f"{view.prefix_hits_total:.1%}"
    recent = "-" if view.prefix_hits_recent is None else f"{view.prefix_hits_recent:.1%}"
    grid.add_row("prefix hits", f"{recent} recently   {hits} since start")
    if s.host_blocks_total:
        grid.add_row("host tier", host_tier(s))
    if (transfer := kv_transfer_text(None, s)) is not None:
        grid.add_row("KV hand-offs", transfer.removeprefix("KV hand-offs ") + " since start")
    st = view.steps
    grid.add_row("step time", "idle" if st is None else
                 f"{st.step_ms:,.2f} ms/step ({st.steps_per_s:,.1f} steps/s): "
                 f"schedule {st.schedule_ms:.2f}  results {st.result_ms:.2f}  "
                 f"workers+idle {st.other_ms:.2f} ms\n"
                 f"device busy {st.gpu_ms:.2f} ms/step ({st.gpu_ms / st.step_ms:.1%})")
    return grid


def host_tier(s: EngineStats) -> Text:
    """The host KV tier since start: its use, prefix hits, what moved, and swaps."""
    bar = kv_bar(s.host_blocks_used, s.host_blocks_total)
    bar.append(f"\nhits {s.host_hit_tokens:,} tok   stored {_moved(s.host_blocks_stored, s)}   "
               f"loaded {_moved(s.host_blocks_loaded, s)}\n"
               f"swaps {s.host_swaps_out:,} out / {s.host_swaps_in:,} in")
    return bar


def _moved(blocks: int, s: EngineStats) -> str:
    """Blocks as bytes when the engine says what a block weighs."""
    if not s.host_block_bytes:
        return f"{blocks:,} blocks"
    size = float(blocks * s.host_block_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:,.1f} {unit}" if unit != "B" else f"{int(size):,} B"


def kv_bar(used: int, total: int, width: int = BAR_WIDTH) -> Text:
    share = used / total if total else 0.0
    filled = round(share * width)
    style = "red" if share > 0.9 else "yellow" if share > 0.7 else "green"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"),
                         f" {used:,}/{total:,} ({share:.1%})")


def _requests(rows: list[RequestView]) -> Table:
    table = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for name, justify in (("request", "right"), ("client request id", "left"),
                          ("tokens", "right"), ("tok/s", "right"), ("age", "right"),
                          ("state", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "state")
    for q in rows:
        tokens = f"{q.tokens:,}" + ("+" if q.joined_late else "")
        tok_s = "-" if q.tok_s is None else f"{q.tok_s:,.1f}"
        table.add_row(str(q.request_id), q.client_request_id or "-", tokens, tok_s,
                      f"{q.age_s:,.1f}s", q.state)
    if not rows:
        table.add_row("", "no requests yet", "", "", "", "")
    if any(q.joined_late for q in rows):
        table.caption = "N+: began before top attached (tokens counted from then)"
    return table
