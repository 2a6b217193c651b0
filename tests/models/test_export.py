"""The GGUF -> HF folder export (for vLLM/SGLang): read once by kiln's own GGUF reader, it must
say what transformers' own GGUF path says, plus the `architectures` engines look up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from kiln.backends import export

    # Only the export goes to a fresh folder: the tokenizer conversion cache is the one every
    # other test uses (converting again costs ~5 s and is tested in test_tokenizer.py).
    out = tmp_path_factory.mktemp("export") / "smollm2"
    mp = pytest.MonkeyPatch()
    mp.setattr(export, "export_dir_for", lambda gguf: out)
    try:
        yield export.export_gguf_as_hf(gguf_path)
    finally:
        mp.undo()


def test_export_config_matches_transformers_reading_the_gguf(exported: Path,
                                                             gguf_path: Path) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(exported).to_dict()
    theirs = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    assert ours.pop("architectures") == ["LlamaForCausalLM"]
    ignored = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "torch_dtype",
               "transformers_version"}
    assert {k: v for k, v in ours.items() if k not in ignored} == \
        {k: v for k, v in theirs.items() if k not in ignored}


def test_export_tokenizer_and_weights_are_kilns(exported: Path, gguf_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from kiln.models.loader import iter_tensors, open_checkpoint
    from kiln.tokenizer import load_tokenizer

    text = "The capital of France is Paris. Ünïcode, too!"
    assert AutoTokenizer.from_pretrained(exported).encode(text) == \
        load_tokenizer(gguf_path).encode(text)
    with safe_open(str(exported / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        q = sf.get_tensor("model.layers.0.self_attn.q_proj.weight")
    ckpt = open_checkpoint(gguf_path)
    want = dict(iter_tensors(ckpt))
    assert names == set(want) - {"rope_freqs"}
    assert q.equal(want["model.layers.0.self_attn.q_proj.weight"].to(q.dtype))
