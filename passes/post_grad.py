"""Running our post-grad passes inside Inductor: the custom post pass object and the config
patches that install it next to any pass the user configured."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
except ImportError:  # torch < 2.12 (the H200 has 2.11): the config holds one pass, not a list
    get_custom_graph_passes = None

from passes.base import GraphPass


class PostGradPasses(CustomGraphPass):
    """Our post-grad passes (``POST_GRAD_ORDER``) as Inductor's custom post pass. Its uuid is the
    whole pipeline's: Inductor folds custom pass uuids into its FX graph cache key, so editing
    any of our passes invalidates cached artifacts. Match counts accumulate in ``counts`` (on an
    Inductor cache hit the passes do not run, the cached code already holds their rewrite, and
    nothing is counted)."""

    def __init__(self, uuid: str, passes: Sequence[GraphPass],
                 inner: CustomGraphPass | None = None) -> None:
        self._uuid = uuid
        self.passes = list(passes)
        self.counts: dict[str, int] = {}
        self._inner = inner  # a pass already configured, kept running (older torch: one slot)

    def __call__(self, graph: fx.Graph) -> None:
        if self._inner is not None:
            self._inner(graph)
        for p in self.passes:
            n = p.apply_graph(graph)  # type: ignore[attr-defined]
            self.counts[p.name] = self.counts.get(p.name, 0) + n
        graph.lint()

    def uuid(self) -> str:
        inner = self._inner.uuid() if self._inner is not None else ""
        return f"{self._uuid}{inner}"


def inductor_patches(config: dict[str, Any], post: PostGradPasses) -> dict[str, Any]:
    """``config`` plus our post pass, keeping a post pass already configured."""
    patches = dict(config)
    existing = patches.get("post_grad_custom_post_pass",
                           torch._inductor.config.post_grad_custom_post_pass)
    if get_custom_graph_passes is None:
        post._inner = existing
        patches["post_grad_custom_post_pass"] = post
    else:
        patches["post_grad_custom_post_pass"] = (*get_custom_graph_passes(existing), post)
    return patches
