"""export-head: reads sharded heads (the shipped one too) and replaces an earlier export whole
(a stale index would make the loader serve the old shards)."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compiled_spec.draft import load_draft
from compiled_spec.draft.testing import write_eagle3_head
from compiled_spec.heads import SHIPPED, SHIPPED_WEIGHTS, resolve_draft
from compiled_spec.models import load_model
from compiled_spec.models.config import ModelConfig
from compiled_spec.train.checkpoint import export_head, head_files
from tests.spec_models import write_bigram_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    target = write_bigram_target(root / "target", vocab=64, layers=3, seed=3)
    cfg = ModelConfig.from_hf_dict(json.loads((root / "target" / "config.json").read_text()))
    head = write_eagle3_head(str(root / "head"), cfg, draft_vocab_size=48)
    return load_model(target, torch.float32, "cpu")[0], head


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in head_files(d):
        out.update(load_file(str(f)))
    return out


def test_reexport_replaces_the_previous_export(pair, tmp_path):
    target, src = pair
    dst = tmp_path / "out"
    export_head(src, dst, "bfloat16", max_shard_mb=0.02)
    assert (dst / "model.safetensors.index.json").is_file()
    files = export_head(src, dst, "float32")  # one file now: the old shards and index must go
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in files) == ["config.json", "model.safetensors"]
    a = load_draft(src, target, torch.float32, "cpu").state_dict()
    b = load_draft(str(dst), target, torch.float32, "cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # float32 exactly, not the bf16 shards


def test_destination_with_other_files_is_refused(pair, tmp_path):
    _, src = pair
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that are not a head export: \['notes.txt'\]"):
        export_head(src, dst, "float32")
    assert (dst / "notes.txt").read_text() == "mine" and len(list(dst.iterdir())) == 1


def test_sharded_heads_export_the_shipped_one_too(pair, tmp_path):
    target, src = pair
    sharded = tmp_path / "sharded"
    export_head(src, sharded, "float32", max_shard_mb=0.02)
    again = tmp_path / "again"
    export_head(sharded, again, "float32")  # sharded in, one file out
    a = load_draft(src, target, torch.float32, "cpu").state_dict()
    b = load_draft(str(again), target, torch.float32, "cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    shipped = Path(resolve_draft("smollm2-eagle3"))
    out = tmp_path / "shipped"
    export_head(shipped, out, "float32")
    want, got = _tensors(shipped), _tensors(out)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v.float() if v.is_floating_point() else v), k


def test_shipped_weights_are_the_ones_their_results_measured():
    """The recorded sha256 of each shipped head is the committed file's, and the result folder
    quoted for it exists: new weights cannot ship without naming what measured them."""
    root = Path(__file__).resolve().parents[1]
    assert SHIPPED_WEIGHTS.keys() == SHIPPED.keys()
    for name, (sha, results) in SHIPPED_WEIGHTS.items():
        weights = Path(resolve_draft(name)) / "model.safetensors"
        assert hashlib.sha256(weights.read_bytes()).hexdigest() == sha, name
        assert (root / results / "README.md").is_file(), results
