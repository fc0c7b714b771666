"""engine/models/families: a model family is one module behind a registry. A family the
engine has never heard of, with its own architecture name and its own tensor names, is served
once its `Family` is registered (config mapping, tensor names, the module it builds), and loads
the same weights a Llama checkpoint with the usual names gives."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import load_arch, load_model
from engine.models.families import Family, family_of, register, unregister
from engine.models.families.base import build_causal_lm, llama_layer_slots, llama_shaped_config

ARCH = "RenamedLlamaForCausalLM"


def _renamed_copy(src: str, dst: str) -> str:
    """The tiny llama checkpoint as a new family would ship it: its own architecture name and
    `self_attn.query` where Llama says `self_attn.q_proj`."""
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = [ARCH]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    save_file({k.replace(".q_proj.", ".query."): v for k, v in tensors.items()}, path)
    return dst


@pytest.fixture
def renamed_family():
    built = []

    def config(cfg, name):
        return llama_shaped_config(cfg, name, default_bias=False, qk_norm=False)

    def layer_slots(model, i):
        return {k.replace(".q_proj.", ".query."): v
                for k, v in llama_layer_slots(model, i).items()}

    def build(arch, dtype, device="cpu", **tp):
        built.append((arch.architecture, tp))
        return build_causal_lm(arch, dtype, device, **tp)

    family = Family("renamed_llama", (ARCH,), config, layer_slots, build)
    register(family)
    try:
        yield built
    finally:
        unregister("renamed_llama")


def test_an_unregistered_architecture_is_refused_naming_it(tiny_model, tmp_path):
    path = _renamed_copy(tiny_model, str(tmp_path / "m"))
    with pytest.raises(ValueError, match=f"unsupported architecture '{ARCH}'.*LlamaForCausalLM"):
        load_arch(path)


def test_a_registered_family_serves_its_names_with_the_same_weights(tiny_model, tmp_path,
                                                                     renamed_family):
    path = _renamed_copy(tiny_model, str(tmp_path / "m"))
    assert load_arch(path).architecture == ARCH
    ours, llama = load_model(path), load_model(tiny_model)
    assert renamed_family == [(ARCH, {"tp_rank": 0, "tp_size": 1, "comm": None})]
    want = llama.state_dict()
    got = ours.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_the_builtin_families_and_a_clash():
    assert [family_of(a).name for a in
            ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")] == [
                "llama", "qwen2", "qwen3"]
    llama = family_of("LlamaForCausalLM")
    with pytest.raises(ValueError, match="clashes"):
        register(Family("other", ("LlamaForCausalLM",), llama.config, llama.layer_slots))
    assert family_of("LlamaForCausalLM") is llama
