"""tools/smollm2_demo.py's conversion, on a tiny GGUF written here as the packaged SmolLM2 file is laid out: llama
architecture, tied embeddings, Q4_1 matrices, Q8_0 embeddings, float32 norms, a byte-level BPE that splits digits
off (llama.cpp's "smollm"), a ChatML template. The real model's run (bash scripts/demo.sh) takes minutes: not here."""

import json
import types

import pytest
import smollm2_demo as demo
import torch
from conftest import SAMPLE

import train

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def smollm_bpe():
    """A byte-level BPE whose pre-tokenizer splits digits off first, as SmolLM2's does, trained on the sample."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    digits, byte_level = pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL, initial_alphabet=alphabet)
    bpe.train_from_iterator([m["content"] for line in open(SAMPLE) for m in json.loads(line)["messages"]], trainer)
    return bpe


def tiny_llama(vocab_size: int):
    """A 2-layer llama, tied embeddings, norms away from 1 so that a norm read wrongly shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    return model


def write_gguf(path, model, bpe) -> dict:
    """model and bpe as llama.cpp writes them; returns the state dict the file holds, dequantized by gguf's own
    reference code (not transformers')."""
    import gguf

    c, Q = model.config, gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    vocab = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([token for token, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([" ".join(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names, held = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers), {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: the file has no output.weight
            continue
        qtype = Q.F32 if tensor.ndim == 1 else Q.Q8_0 if name == "model.embed_tokens.weight" else Q.Q4_1
        packed = gguf.quants.quantize(tensor.numpy(), qtype)
        held[name] = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
        if heads:  # llama.cpp's rotary layout: each head's rows interleaved (convert_hf_to_gguf's permute)
            packed = packed.reshape(heads, 2, -1, packed.shape[1]).swapaxes(1, 2).reshape(packed.shape)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), packed, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(GGUF path, converted folder, the model the GGUF holds, the BPE it was written from)."""
    tmp, bpe = tmp_path_factory.mktemp("gguf"), smollm_bpe()
    model = tiny_llama(bpe.get_vocab_size())
    gguf_path = tmp / "tiny.Q4_1.gguf"
    model.load_state_dict(write_gguf(gguf_path, model, bpe), strict=False)  # lm_head is tied to embed_tokens
    return gguf_path, demo.convert(gguf_path, tmp / "hf"), model.eval(), bpe


def job(model_dir, **settings) -> train.Config:
    return train.Config(**{**demo.JOB, "model_name": str(model_dir), "max_seq_len": 512, **settings})


def test_the_converted_folder_holds_the_gguf_model(converted):
    """Its logits are the GGUF's weights' (dequantized by gguf's code) and transformers' own GGUF load's."""
    from transformers import AutoModelForCausalLM

    gguf_path, out, held, _ = converted
    assert set(train.checkpoint_dtypes(out).values()) == {torch.float32}
    ids = torch.arange(3, 120)[None]
    model = AutoModelForCausalLM.from_pretrained(out)
    own = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, own(ids).logits)
        torch.testing.assert_close(logits, held(ids).logits, rtol=0, atol=1e-5)


def test_the_tokenizer_is_the_ggufs_with_its_chat_template(converted):
    """The ids of the written BPE on every sample conversation, the template as written; digits split off first
    (transformers alone would cut "\\n\\n1" into "\\n", "\\n", "1")."""
    _, out, _, bpe = converted
    tokenizer = train.load_tokenizer(job(out))
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.tokenize("Steps:\n\n1.") == bpe.encode("Steps:\n\n1.").tokens
    assert "ĊĊ" in tokenizer.tokenize("Steps:\n\n1.")
    for line in open(SAMPLE):
        messages = json.loads(line)["messages"]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert text == chatml(messages)
        assert tokenizer(text, add_special_tokens=False).input_ids == bpe.encode(text).ids


def test_train_py_reads_it_and_the_heldout_loss_is_its_eval(converted, world_of_one):
    """train.py's loaders and its FSDP model take the folder; the demo's held-out loss on those weights is the
    loss train.py's Evaluator reports."""
    _, out, _, _ = converted
    cfg = job(out, eval_blocks=2)
    tokenizer, config = train.load_tokenizer(cfg), train.model_config(out)
    assert config.tie_word_embeddings and not config.use_cache
    model = train.build_model(config, cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, out, train.checkpoint_dtypes(out))
    filler = train.filler_block(train.pad_token_id(tokenizer))
    evaluator = train.Evaluator(cfg, tokenizer, world_of_one, filler, types.SimpleNamespace(write=lambda record: None))
    evaluator.evaluate(model, step=0)
    blocks = demo.eval_blocks(cfg, tokenizer, world_size=1)
    assert len(blocks) == 2 and all(b["loss_tokens"] for b in blocks)
    assert demo.heldout_loss(demo.load_model(out, cfg), blocks, cfg) == pytest.approx(evaluator.last_loss, rel=1e-4)


def test_a_second_conversion_is_the_cached_folder(converted, monkeypatch):
    import transformers

    gguf_path, out, _, _ = converted

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    assert demo.convert(gguf_path, out) == out
