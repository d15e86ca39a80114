"""Bad GGUF input: each defect gives exactly one clear line naming the file (and tensor) and a non-zero exit,
never a traceback -- through ``glm5serve verify`` and ``glm5serve inspect``. The bad files are built here."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFWriter

import glm5serve
from glm5serve.cli import main
from glm5serve.gguf_file import GGUFModel


def _raw(rows: int, row: int, qtype: Q, seed: int = 0) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 256, (rows, row // block * size), dtype=np.uint8)


def _patch_tensor_type(path: Path, tensor: str, type_id: int) -> None:
    """Overwrite a tensor's ggml type id in the header (an id no ggml knows)."""
    r = GGUFReader(path)
    (t,) = [t for t in r.tensors if t.name == tensor]
    f = t.field
    offset = f.offset + sum(p.nbytes for p in f.parts[:4])  # name len, name, n_dims, dims -> type
    del r
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<I", type_id))


@pytest.fixture(scope="module")
def bad(tiny_bf16_checkpoint, tiny_checkpoint, tiny_split_checkpoint, tmp_path_factory, gguf_rewrite):
    """name -> (path of the bad model, tensor the message must name or None, words the message must contain)."""
    d = tmp_path_factory.mktemp("bad")
    out, rewrite = {}, gguf_rewrite

    trunc = d / "truncated.gguf"
    shutil.copy(tiny_bf16_checkpoint, trunc)
    with open(trunc, "r+b") as fh:
        fh.truncate(int(trunc.stat().st_size * 0.6))
    last_whole = [t for t in GGUFReader(tiny_bf16_checkpoint).tensors if t.data_offset + t.n_bytes >
                  int(trunc.stat().st_size)][0].name
    out["truncated"] = (trunc, last_whole, "truncated")

    shards = d / "split"
    shards.mkdir()
    for p in GGUFModel(tiny_split_checkpoint).paths:
        shutil.copy(p, shards / p.name)
    first = shards / tiny_split_checkpoint.name
    (shards / first.name.replace("00001-of", "00002-of")).unlink()
    out["missing shard"] = (first, None, "missing shard")

    llama = d / "llama.gguf"
    w = GGUFWriter(llama, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["foreign arch"] = (llama, None, "'llama'")

    src = tiny_bf16_checkpoint
    out["missing tensor"] = (rewrite(src, d / "missing.gguf", drop={"blk.1.attn_q_b.weight"}),
                             "blk.1.attn_q_b.weight", "missing")
    out["extra tensor"] = (rewrite(src, d / "extra.gguf", add={"blk.0.attn_bogus.weight": (
        np.zeros((4, 256), np.float32), Q.F32)}), "blk.0.attn_bogus.weight", "unknown tensor")
    out["wrong shape"] = (rewrite(src, d / "shape.gguf", replace={"blk.2.attn_q_a.weight": (
        np.zeros((128, 256), np.float32), Q.F32)}), "blk.2.attn_q_a.weight", "shape")
    # llama.cpp takes ne padded with 1s at the end ([K, N, 1] for [K, N]); a 1 anywhere else is another tensor
    out["size-1 dim inside"] = (rewrite(src, d / "inner_one.gguf", reshape={"blk.1.attn_q_b.weight": (384, 1, 256)}),
                                "blk.1.attn_q_b.weight", "shape (384, 1, 256) (numpy order), expected (384, 256)")
    out["size-1 dim innermost"] = (rewrite(src, d / "last_one.gguf", reshape={"blk.1.attn_norm.weight": (256, 1)}),
                                   "blk.1.attn_norm.weight", "shape (256, 1) (numpy order), expected (256,)")
    for qtype in (Q.TQ1_0, Q.IQ2_XXS, Q.Q8_1):
        out[f"unsupported {qtype.name}"] = (
            rewrite(src, d / f"{qtype.name}.gguf",
                    replace={"blk.0.attn_q_a.weight": (_raw(256, 256, qtype), qtype)}),
            "blk.0.attn_q_a.weight", qtype.name)
    unknown = rewrite(src, d / "unknown_type.gguf", replace={"blk.0.attn_q_a.weight": (_raw(256, 256, Q.Q8_0),
                                                                                        Q.Q8_0)})
    _patch_tensor_type(unknown, "blk.0.attn_q_a.weight", 250)
    out["unknown type id"] = (unknown, "blk.0.attn_q_a.weight", "250")

    nan = d / "nan_scale.gguf"
    shutil.copy(tiny_checkpoint, nan)
    t = GGUFModel(tiny_checkpoint)["blk.1.attn_k_b.weight"]
    assert t.qtype == Q.Q8_0
    block_bytes = GGML_QUANT_SIZES[Q.Q8_0][1]
    with open(nan, "r+b") as fh:  # the fp16 scale d of block 3 := NaN
        fh.seek(t.data_offset + 3 * block_bytes)
        fh.write(struct.pack("<H", 0x7E00))
    out["NaN scale"] = (nan, "blk.1.attn_k_b.weight", "non-finite")
    out["metadata"] = (rewrite(src, d / "metadata.gguf", set_keys={"glm-dsa.attention.key_length": 999}), None,
                       "key_length=999")
    out["no such file"] = (d / "nope.gguf", None, "no such file")
    return out


CASES = ["truncated", "missing shard", "foreign arch", "missing tensor", "extra tensor", "wrong shape",
         "size-1 dim inside", "size-1 dim innermost",
         "unsupported TQ1_0", "unsupported IQ2_XXS", "unsupported Q8_1", "unknown type id", "NaN scale", "metadata",
         "no such file"]


@pytest.mark.parametrize("case", CASES)
def test_verify_gives_one_line_naming_file_and_tensor(case, bad, capsys):
    path, tensor, words = bad[case]
    rc = main(["verify", str(path)])
    out, err = capsys.readouterr()
    assert rc != 0
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1, out
    line = fails[0]
    named_file = path.name if case != "missing shard" else path.name.replace("00001-of", "00002-of")
    assert named_file in line and words in line, line
    if tensor is not None:
        assert tensor in line, line
    assert "Traceback" not in out + err and err == ""
    assert out.splitlines()[-1].startswith("verify: FAILED")


OPEN_FAILURES = ["truncated", "missing shard", "unknown type id", "no such file"]


@pytest.mark.parametrize("case", OPEN_FAILURES)
def test_inspect_gives_one_line_and_exit_2(case, bad, capsys):
    path, tensor, words = bad[case]
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and words in err and "Traceback" not in err
    if tensor is not None:
        assert tensor in err


def test_unsupported_type_is_listed_by_inspect(bad, capsys):
    path, tensor, _ = bad["unsupported TQ1_0"]
    assert main(["inspect", "--json", str(path)]) == 0
    assert '"TQ1_0"' in capsys.readouterr().out


def test_console_script_prints_no_traceback(bad):
    path, tensor, _ = bad["truncated"]
    proc = subprocess.run([sys.executable, "-m", "glm5serve.cli", "inspect", str(path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and tensor in proc.stderr and "Traceback" not in proc.stderr


def test_generate_on_a_terminal_that_is_not_utf8(tiny_checkpoint):
    """PYTHONIOENCODING=latin-1 (or a prompt of 'héllo' under ASCII) gave a UnicodeEncodeError traceback for the
    generated text (fresh-user finding): what the terminal cannot show is escaped."""
    src = str(Path(glm5serve.__file__).parents[1])
    for encoding, prompt in (("latin-1", "hi"), ("ascii", "h\u00e9llo \u4f60\u597d")):
        env = dict(os.environ, PYTHONIOENCODING=encoding,
                   PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "glm5serve.cli", "generate", str(tiny_checkpoint), "--prompt",
                               prompt, "--max-tokens", "4"], capture_output=True, env=env, timeout=300)
        assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
        assert proc.stdout.decode(encoding).strip(), proc.stdout


# ---------------------------------------------------------------- bad input a new-user trial found: every command
# that opens the model (inspect, verify, generate) refuses it in one line naming the file (and key or tensor).

def _one_line(argv: list[str], capsys, *words: str) -> str:
    """Run the CLI; assert exit 2 and exactly one stderr line holding ``words``, no traceback; return the line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def _verify_fail(path: Path, capsys, *words: str) -> str:
    """``verify`` fails with exactly one FAIL line holding ``words``; return it."""
    assert main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and "Traceback" not in out + err, out + err
    for w in words:
        assert w in fails[0], fails[0]
    return fails[0]


def _string_offset(path: Path, key: str) -> tuple[int, int]:
    """(file offset of the first byte, element index) of an ASCII string of >= 2 bytes in the string array ``key``."""
    r = GGUFReader(path)
    f = r.fields[key]
    base = r.data.__array_interface__["data"][0]
    for i, idx in enumerate(f.data):
        b = f.parts[idx].tobytes()
        if len(b) >= 2 and b[:2].isascii() and b[:2].isalpha():
            return f.parts[idx].__array_interface__["data"][0] - base, i
    raise AssertionError(f"no ASCII string in {key}")


@pytest.fixture(scope="module")
def bad_utf8(tiny_checkpoint, tmp_path_factory) -> tuple[Path, int]:
    """The tiny checkpoint with one tokenizer.ggml.tokens string made invalid UTF-8 (a lead byte before ASCII)."""
    path = tmp_path_factory.mktemp("utf8") / "bad_utf8.gguf"
    shutil.copy(tiny_checkpoint, path)
    offset, element = _string_offset(path, "tokenizer.ggml.tokens")
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x80
    path.write_bytes(bytes(b))
    return path, element


@pytest.mark.parametrize("command", ["inspect", "verify", "generate"])
def test_invalid_utf8_token_names_key_and_element(command, bad_utf8, capsys):
    path, element = bad_utf8
    words = (path.name, f"tokenizer.ggml.tokens: invalid UTF-8 at element {element}")
    if command == "verify":
        _verify_fail(path, capsys, *words)
    else:
        _one_line([command, str(path)] + (["--prompt", "Hi"] if command == "generate" else []), capsys, *words)


@pytest.mark.parametrize("n_bytes", [0, 3, 4, 8, 24, 100, 1000])
def test_truncated_header_says_so(n_bytes, tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / f"head{n_bytes}.gguf"
    path.write_bytes(tiny_checkpoint.read_bytes()[:n_bytes])
    line = _one_line(["inspect", str(path)], capsys, path.name, "not a readable GGUF file: header truncated or corrupt: "
                     f"the file is {n_bytes} bytes")
    if n_bytes < 24:
        assert "ends inside GGUF's 24-byte fixed header" in line, line
    else:  # the counts the fixed header declares, read independently with gguf-py from the whole file
        from gguf import GGUFReader

        whole = GGUFReader(tiny_checkpoint)
        assert f"declares {len(whole.fields) - 3} metadata keys and {len(whole.tensors)} tensors" in line, line
    assert "(gguf-py: " in line and line.rstrip().endswith(")") and "()" not in line  # gguf-py's reason is kept
    _verify_fail(path, capsys, path.name, "header truncated or corrupt")


@pytest.mark.parametrize("version,shown", [(1, 1), (4, 4), (5 << 24, "5 (field bytes 00 00 00 05, read as big-endian;"),
                                           (5 << 16, "1280 (field bytes 00 00 05 00, read as big-endian;")])
def test_unsupported_version_is_not_called_truncated(version, shown, tiny_checkpoint, tmp_path, capsys):
    """A GGUF of a version gguf-py cannot read (v1, a future v4, fields gguf-py reads as big-endian) is named as such,
    not as a truncated or corrupt header; a byte-swapped reading says so."""
    path = tmp_path / f"v{version}.gguf"
    b = bytearray(tiny_checkpoint.read_bytes())
    b[4:8] = version.to_bytes(4, "little")
    path.write_bytes(bytes(b))
    line = _one_line(["inspect", str(path)], capsys, path.name, f"unsupported GGUF version {shown} ",
                     "versions 2 and 3")
    assert "truncated" not in line and "Sorry" not in line
    _verify_fail(path, capsys, path.name, "unsupported GGUF version")


@pytest.mark.parametrize("flag,value,least", [("--max-tokens", "0", 1), ("--max-tokens", "-1", 1),
                                              ("--logprobs", "-2", 0)])
def test_generate_names_the_bad_flag(flag, value, least, tiny_checkpoint, capsys):
    other = "--logprobs" if flag == "--max-tokens" else "--max-tokens"
    line = _one_line(["generate", str(tiny_checkpoint), "--prompt", "Hi", flag, value, other, "1"], capsys,
                     f"{flag} {value} must be >= {least}")
    assert other not in line


def test_directory_and_empty_path(tmp_path, capsys):
    _one_line(["inspect", str(tmp_path)], capsys, str(tmp_path), "is a directory")
    _one_line(["inspect", ""], capsys, "empty path")
    _one_line(["generate", str(tmp_path), "--prompt", "Hi"], capsys, "is a directory")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs and symlinks")
def test_what_is_not_a_file_is_named_for_what_it_is(tiny_split_checkpoint, tmp_path, capsys):
    # each of these was reported as "no such file" (fresh-user finding); a FIFO would block gguf-py's mmap
    fifo, loop, dangling = tmp_path / "pipe.gguf", tmp_path / "loop.gguf", tmp_path / "dangling.gguf"
    os.mkfifo(fifo)
    loop.symlink_to(loop.name)
    dangling.symlink_to("gone.gguf")
    for path, words in ((fifo, "not a regular file (a FIFO, socket or device)"),
                        (loop, "a symlink loop"), (dangling, "a broken symbolic link (to gone.gguf)"),
                        (tmp_path / "nope.gguf", "no such file")):
        _one_line(["inspect", str(path)], capsys, path.name, words)
    # a split set whose second shard is a FIFO: not "missing"
    shards = sorted(tiny_split_checkpoint.parent.glob("*-of-*.gguf"))
    for s in shards:
        (tmp_path / s.name).symlink_to(s)
    (tmp_path / shards[1].name).unlink()
    os.mkfifo(tmp_path / shards[1].name)
    _one_line(["inspect", str(tmp_path / shards[0].name)], capsys, shards[1].name,
              "unreadable (not a regular file (a FIFO, socket or device): a GGUF file is memory-mapped) shard")


def test_a_big_endian_file_is_refused(tiny_checkpoint, tmp_path, capsys):
    # gguf-py reads it byte-swapped: an F32 model passed verify and generated, while the block types' fp16 scales
    # were decoded as stored (a "non-finite value" at best); llama.cpp refuses such a file (fresh-user finding)
    from gguf import GGUFEndian

    r = GGUFReader(tiny_checkpoint)
    path = tmp_path / "big.gguf"
    w = GGUFWriter(path, "glm-dsa", endianess=GGUFEndian.BIG)
    w.add_block_count(3)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert GGUFReader(path).byte_order == "S" and r.byte_order == "I"
    want = "big-endian GGUF file: not supported, as by llama.cpp"
    _one_line(["inspect", str(path)], capsys, "big.gguf", want)
    assert _verify_fail(path, capsys, "big.gguf", want).startswith("FAIL  files")


@pytest.mark.skipif(not hasattr(os, "geteuid") or (os.geteuid() == 0 and not shutil.which("setpriv")),
                    reason="needs a POSIX user without root's file access (setpriv drops it for root)")
def test_a_folder_that_cannot_be_entered_is_a_failed_check(tiny_checkpoint, tmp_path):
    # Path.is_symlink() re-raised the PermissionError: verify printed no FAIL line and no verdict, and a link into
    # the folder was called "a broken symbolic link" (fresh-user finding)
    closed = tmp_path / "closed"
    closed.mkdir()
    shutil.copy(tiny_checkpoint, closed / "b.gguf")
    (tmp_path / "link.gguf").symlink_to("closed/b.gguf")
    closed.chmod(0)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"] if os.geteuid() == 0 else []
    src = str(Path(glm5serve.__file__).parents[1])  # run from tmp_path: this checkout's package, not another
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    try:
        for args, rc, want in ((["verify", "closed/b.gguf"], 1, "FAIL  files      closed/b.gguf: permission denied"),
                               (["inspect", "link.gguf"], 2, "glm5serve inspect: link.gguf: permission denied")):
            proc = subprocess.run([*drop, sys.executable, "-m", "glm5serve.cli", *args], capture_output=True, text=True,
                                  cwd=tmp_path, env=env, timeout=300)
            assert proc.returncode == rc and "Traceback" not in proc.stderr, proc.stderr
            assert want in (proc.stdout + proc.stderr).splitlines(), proc.stdout + proc.stderr
    finally:
        closed.chmod(0o755)


def test_generate_names_a_foreign_architecture_first(bad, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    path, _, _ = bad["foreign arch"]  # a llama GGUF without any tokenizer keys
    _one_line(["generate", str(path), "--prompt", "Hi"], capsys, path.name, "architecture is 'llama', not 'glm-dsa'")
    gemma = gguf_rewrite(tiny_checkpoint, tmp_path / "gemma3.gguf", arch="gemma3")  # a GLM tokenizer, gemma3 arch
    _one_line(["generate", str(gemma), "--prompt", "Hi"], capsys, gemma.name, "architecture is 'gemma3', not 'glm-dsa'")


def _with_key(src: Path, dst: Path, key: str, value, vtype) -> Path:
    """Copy a single-file GGUF with metadata ``key`` stored as ``value`` of GGUF type ``vtype`` (any type)."""
    from gguf import GGUFValueType

    r = GGUFReader(src)
    w = GGUFWriter(dst, "glm-dsa")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", key):
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY
                        else None)
    w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_chat_template_that_does_not_render(tiny_checkpoint, tmp_path, capsys):
    """verify passed a tokenizer.chat_template of "{% for %}", and serve started a server whose every chat request
    would fail (fresh-user finding). vLLM's --chat-template replaces it; bench sends token ids and never uses it."""
    from gguf import GGUFValueType

    path = _with_key(tiny_checkpoint, tmp_path / "template.gguf", "tokenizer.chat_template", "{% for %}",
                     GGUFValueType.STRING)
    line = _verify_fail(path, capsys, "template.gguf", "tokenizer.chat_template renders no conversation",
                        "TemplateSyntaxError")
    assert line.startswith("FAIL  tokenizer")
    _one_line(["serve", str(path), "--dry-run"], capsys, "template.gguf", "renders no conversation")
    for replaced in (["--chat-template", "{{ messages[0].content }}"], ["--tokenizer", "zai-org/GLM-5"]):
        assert main(["serve", str(path), "--dry-run", *replaced]) == 0
    capsys.readouterr()
    # templates vLLM serves: one reading OpenAI-style content parts (vLLM detects it and sends parts), one that
    # wants a system message first (review findings: both failed verify and blocked serve)
    for i, template in enumerate((
            "{% for m in messages %}<|{{ m.role }}|>{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
            "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")):
        ok = _with_key(tiny_checkpoint, tmp_path / f"ok{i}.gguf", "tokenizer.chat_template", template,
                       GGUFValueType.STRING)
        assert main(["verify", str(ok)]) == 0, capsys.readouterr().out
        assert "chat template renders" in capsys.readouterr().out
    _one_line(["bench", str(path)], capsys, "CUDA GPU")  # past the pre-flight: no GPU here
    assert main(["verify", str(tiny_checkpoint)]) == 0
    assert "chat template renders" in capsys.readouterr().out


@pytest.mark.parametrize("key,value,vtype,expected", [
    ("glm-dsa.block_count", "four", "STRING", "an integer"),
    ("glm-dsa.attention.layer_norm_rms_epsilon", "x", "STRING", "a number"),
    # a boolean is not a count (fresh-user finding: top_k stored as true ran with index_topk 1)
    ("glm-dsa.attention.indexer.top_k", True, "BOOL", "an integer"),
    # fresh-user finding: a traceback from the tokenizer's int('x') in generate, an unnamed key in verify
    ("tokenizer.ggml.unknown_token_id", "x", "STRING", "an integer"),
    # a count stored as a fractional number is no count (int() would take 2.5 as 2 experts per token)
    ("glm-dsa.expert_used_count", 2.5, "FLOAT32", "an integer"),
    # nor is a whole one: llama.cpp refuses a FLOAT32 count ("wrong type f32 but expected type u32")
    ("glm-dsa.attention.head_count", 4.0, "FLOAT32", "an integer"),
])
def test_metadata_of_the_wrong_type_names_key_and_type(key, value, vtype, expected, tiny_checkpoint, tmp_path,
                                                       capsys):
    from gguf import GGUFValueType

    path = _with_key(tiny_checkpoint, tmp_path / "wrong_type.gguf", key, value, GGUFValueType[vtype])
    words = (path.name, key, repr(value), f"expected {expected}")
    if key.endswith("block_count"):  # inspect reads the layer count
        _one_line(["inspect", str(path)], capsys, *words)
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "1"], capsys, *words)
    _verify_fail(path, capsys, *words)


@pytest.mark.parametrize("key,value,words", [
    ("glm-dsa.expert_used_count", 99, "expert_used_count=99 not in 1..expert_count="),
    ("glm-dsa.context_length", 0, "glm-dsa.context_length=0 is not positive"),
    ("tokenizer.ggml.eos_token_id", "vocab", "tokenizer.ggml.eos_token_id="),
    ("tokenizer.ggml.bos_token_id", "vocab", "tokenizer.ggml.bos_token_id="),
    # stop ids and padding too (fresh-user finding: both passed verify)
    ("tokenizer.ggml.eot_token_id", "vocab", "tokenizer.ggml.eot_token_id="),
    ("tokenizer.ggml.padding_token_id", "vocab", "tokenizer.ggml.padding_token_id="),
    ("tokenizer.ggml.unknown_token_id", "vocab", "tokenizer.ggml.unknown_token_id="),
])
def test_metadata_no_engine_can_run_is_refused_by_every_command(key, value, words, tiny_checkpoint, tmp_path,
                                                                gguf_rewrite, capsys):
    vocab = len(GGUFModel(tiny_checkpoint).metadata["tokenizer.ggml.tokens"])
    value = vocab if value == "vocab" else value  # the first id past the vocabulary
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "inconsistent.gguf", set_keys={key: value})
    _verify_fail(path, capsys, path.name, words)
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "1"], capsys, path.name, words)


def test_verify_does_not_pass_a_synthetic_header_as_finite(tmp_path, capsys):
    from glm5serve.synthetic import write_header

    path = write_header(tmp_path / "header.gguf", "tiny")  # its data section is a hole: it reads as zeros
    line = _verify_fail(path, capsys, path.name,
                        "synthetic header without tensor data (serve it with --load-format glm5-synthetic)")
    assert line.split()[1] == "finite", line


@pytest.fixture(scope="module")
def non_finite(bad, tiny_checkpoint, tmp_path_factory, gguf_rewrite) -> dict[str, tuple[Path, str]]:
    """name -> (model whose one weight dequantizes to NaN/Inf, that tensor)."""
    d = tmp_path_factory.mktemp("non_finite")
    m = GGUFModel(tiny_checkpoint)
    norm = m["output_norm.weight"]
    gate = next(t for t in m if t.name.endswith("ffn_gate_inp.weight"))  # the first MoE layer's router
    assert norm.qtype == gate.qtype == Q.F32
    nan_scale, tensor, _ = bad["NaN scale"]
    return {
        "NaN block scale": (nan_scale, tensor),
        "NaN output_norm": (gguf_rewrite(tiny_checkpoint, d / "nan_norm.gguf", replace={norm.name: (
            np.full(norm.shape, np.nan, np.float32), Q.F32)}), norm.name),
        "inf router": (gguf_rewrite(tiny_checkpoint, d / "inf_gate.gguf", replace={gate.name: (
            np.full(gate.shape, np.inf, np.float32), Q.F32)}), gate.name),
    }


@pytest.mark.parametrize("case", ["NaN block scale", "NaN output_norm", "inf router"])
def test_generate_refuses_weights_that_dequantize_to_nan_or_inf(case, non_finite, capsys):
    path, tensor = non_finite[case]
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "2"], capsys, path.name, tensor,
              "non-finite values after dequantization (NaN/Inf)")
    _verify_fail(path, capsys, path.name, tensor, "non-finite")


def test_generate_refuses_a_file_whose_tail_is_zeros(tiny_checkpoint, tmp_path, capsys):
    """Fresh-user finding: a file the right size whose second half was never downloaded (zeros) generated
    'The capital of France is!!!!!!!!'; the reference now refuses its first weight matrix of zeros, in one line."""
    path = tmp_path / "prealloc.gguf"
    shutil.copy(tiny_checkpoint, path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(size - size // 2))
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "2"], capsys, path.name,
              "every value is zero, which no trained ")  # weight matrix or norm weight: the first one loaded


def test_a_norm_weight_of_zeros_is_refused_by_verify_and_generate(tiny_checkpoint, tmp_path, capsys):
    """Fresh-user finding: output_norm.weight (the file's last tensor here, so the first an unfilled download zeroes)
    read as zeros passed verify and generated 'The capital of France is!!!!!!!!': only weight matrices were held
    to it. A bias of zeros (the router's exp_probs_b.bias) still passes."""
    for name, refused in (("output_norm.weight", True), ("blk.1.attn_kv_a_norm.weight", True),
                          ("blk.1.exp_probs_b.bias", False)):
        path = tmp_path / f"{name}.gguf"
        shutil.copy(tiny_checkpoint, path)
        t = GGUFModel(path)[name]
        with open(path, "r+b") as f:
            f.seek(t.data_offset)
            f.write(bytes(t.n_bytes))
        if not refused:
            assert main(["verify", str(path)]) == 0, capsys.readouterr().out
            capsys.readouterr()
            continue
        words = (path.name, name, "every value is zero, which no trained norm weight is")
        _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "2"], capsys, *words)
        _verify_fail(path, capsys, *words)


# ---------------------------------------------------------------- a second new-user trial (session 4): headers
# llama.cpp refuses, metadata numbers that give NaN logits, a block_count that sizes everything after it.

def _patch_tensor_offset(path: Path, tensor: str, offset: int) -> None:
    """Overwrite a tensor's data offset (relative to the data section) in the header."""
    r = GGUFReader(path)
    (t,) = [t for t in r.tensors if t.name == tensor]
    at = t.field.offset + sum(p.nbytes for p in t.field.parts[:5])  # name len, name, n_dims, dims, type -> offset
    del r
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<Q", offset))


def _offsets(path: Path) -> list[tuple[str, int]]:
    r = GGUFReader(path)
    return [(t.name, int(t.field.parts[5][0])) for t in r.tensors]


def test_a_tensor_name_that_is_not_utf8(tiny_checkpoint, tmp_path, capsys):
    """A header byte flipped inside a tensor name: gguf-py's "'utf-8' codec can't decode" named no tensor (fresh-user
    finding); the message names the tensor's place in the header and the one before it."""
    path = tmp_path / "name.gguf"
    shutil.copy(tiny_checkpoint, path)
    r = GGUFReader(path)
    names = [t.name for t in r.tensors]
    at = r.tensors[3].field.offset + r.tensors[3].field.parts[0].nbytes  # the name's first byte
    del r
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(b"\xff")
    for command in (["inspect"], ["generate", "--prompt", "Hi"]):
        _one_line([command[0], str(path), *command[1:]], capsys, path.name,
                  f"tensor name #3 (after {names[2]}) is not valid UTF-8")
    _verify_fail(path, capsys, "tensor name #3", "is not valid UTF-8")


def test_a_file_that_is_not_gguf(tmp_path, capsys):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n")
    _one_line(["inspect", str(path)], capsys, path.name, "not a GGUF file", "b'thes'")
    _verify_fail(path, capsys, path.name, "not a GGUF file")


@pytest.mark.parametrize("how", ["overlap", "shifted"])
def test_overlapping_or_misplaced_tensor_data(how, tiny_checkpoint, tmp_path, capsys):
    """llama.cpp (gguf.cpp) requires each tensor's data to start where the previous one's padded data ends; a header
    that points two tensors at the same bytes or off by a few bytes is refused, naming the tensor, not read as
    other tensors' bytes (which passed ``verify`` whenever the bytes happened to decode to finite values)."""
    path = tmp_path / f"{how}.gguf"
    shutil.copy(tiny_checkpoint, path)
    offsets = _offsets(path)
    name, offset = offsets[5] if how == "overlap" else offsets[0]
    _patch_tensor_offset(path, name, offsets[4][1] if how == "overlap" else offset + 4)
    for command in (["inspect"], ["generate", "--prompt", "Hi"]):
        _one_line([command[0], str(path), *command[1:]], capsys, path.name, name, "overlapping or misplaced")
    _verify_fail(path, capsys, name, "overlapping or misplaced")


@pytest.mark.parametrize("alignment", [8, 64, 256])
def test_custom_alignment_is_read(alignment, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """``general.alignment`` other than 32 is legal GGUF (llama.cpp reads it): every command crashed on it with an
    OverflowError traceback, gguf-py keeping the value as np.uint32 (fresh-user finding). Same logits as before.

    Every tensor of the tiny checkpoint is a whole number of 64 bytes, so only 256 makes the writer pad between
    tensors: without it, reading each tensor's data where the previous one's *unpadded* data ends (the offset check
    of ``gguf_file._Reader``) passed the suite, and would refuse valid files as overlapping."""
    import torch

    from glm5serve.reference import ReferenceModel

    path = gguf_rewrite(tiny_checkpoint, tmp_path / f"align{alignment}.gguf", alignment=alignment)
    model = GGUFModel(path)
    assert model.metadata["general.alignment"] == alignment
    assert any(t.n_bytes % alignment for t in model) == (alignment == 256)  # padding between tensors at 256
    assert main(["inspect", str(path)]) == 0
    ids = [1, 5, 9, 2]
    original = ReferenceModel.from_gguf(tiny_checkpoint).forward(ids)
    assert torch.equal(ReferenceModel.from_gguf(path).forward(ids), original)


@pytest.mark.parametrize("alignment", [48, 3])
def test_an_alignment_that_is_no_power_of_two_is_named(alignment, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """ggml and gguf-py want a non-zero power of two; the file is otherwise whole, so the line names the key and
    not a 'header truncated or corrupt' (fresh-user finding)."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / f"align{alignment}.gguf", alignment=64)  # gguf-py writes no 48
    data = bytearray(path.read_bytes())
    at = data.index(b"general.alignment") + len(b"general.alignment") + 4  # after the key: UINT32 type, value
    assert struct.unpack_from("<I", data, at) == (64,)
    struct.pack_into("<I", data, at, alignment)
    path.write_bytes(data)
    line = _one_line(["inspect", str(path)], capsys, path.name,
                     "bad general.alignment (gguf-py: Invalid alignment: must be a non-zero power of two)")
    assert "truncated" not in line


@pytest.mark.parametrize("key,value,words", [
    ("glm-dsa.attention.layer_norm_rms_epsilon", -1.0, "is not a positive finite number"),
    ("glm-dsa.attention.layer_norm_rms_epsilon", float("nan"), "is not a positive finite number"),
    ("glm-dsa.rope.freq_base", -5.0, "is not a positive finite number"),
    ("glm-dsa.expert_weights_scale", 0.0, "is not a positive finite number"),
    ("glm-dsa.block_count", 4_000_000_000, "but the file's tensors stop at blk.3"),
    # too small: it was reported as the MTP tensors missing from what is a main layer (fresh-user finding)
    ("glm-dsa.block_count", 2, "glm-dsa.block_count=2 but the file holds tensors up to blk.3"),
    # each names its key (fresh-user finding: one message named none of the three)
    ("glm-dsa.attention.head_count", 0, "glm-dsa.attention.head_count=0 is not positive"),
    ("glm-dsa.attention.indexer.head_count", 0, "glm-dsa.attention.indexer.head_count=0 is not positive"),
    ("glm-dsa.attention.indexer.top_k", 0, "glm-dsa.attention.indexer.top_k=0 is not positive"),
    ("glm-dsa.rope.dimension_count", 0, "but glm-dsa.attention.kv_lora_rank + glm-dsa.rope.dimension_count ("),
])
def test_metadata_numbers_that_cannot_run(key, value, words, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """Before: a NaN or negative epsilon / rope base passed ``verify`` and ``generate`` printed NaN logprobs with
    exit 0; block_count=4e9 made ``verify`` build a 4e9-layer tensor inventory until the OOM killer came."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "bad.gguf", set_keys={key: value})
    _verify_fail(path, capsys, path.name, key, words)
    _one_line(["generate", str(path), "--prompt", "Hi"], capsys, path.name, key, words)


@pytest.mark.parametrize("keys,words", [
    ({"glm-dsa.expert_group_count": 3}, "glm-dsa.expert_group_count=3 does not divide expert_count=16"),
    ({"glm-dsa.expert_group_count": 4, "glm-dsa.expert_group_used_count": 5},
     "glm-dsa.expert_group_used_count=5 not in 1..expert_group_count=4"),
    ({"glm-dsa.expert_group_count": 16, "glm-dsa.expert_group_used_count": 4}, "leaves 1 expert per group"),
    ({"glm-dsa.expert_group_count": 8, "glm-dsa.expert_used_count": 4},
     "glm-dsa.expert_group_used_count=1 groups of 2 experts hold fewer than expert_used_count=4"),
])
def test_grouped_routing_that_cannot_run(keys, words, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """Before: verify passed each file and generate died in the router with a RuntimeError traceback (fresh-user
    finding); the groups must divide the experts, and the chosen groups must hold top-k experts."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "groups.gguf", set_keys=keys)
    _verify_fail(path, capsys, path.name, words)
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "1"], capsys, path.name, words)


def test_grouped_routing_that_can_run_is_accepted(tiny_checkpoint):
    """The checks above leave a valid grouped router alone: 16 experts in 4 groups, the best 2 groups, top-2."""
    from glm5serve.config import config_from_metadata

    md = dict(GGUFModel(tiny_checkpoint).metadata)
    md.update({"glm-dsa.expert_group_count": 4, "glm-dsa.expert_group_used_count": 2})
    cfg = config_from_metadata(md)
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (4, 2, 2)


@pytest.mark.parametrize("key,value,words", [
    ("glm-dsa.rope.dimension_count", 31, "glm-dsa.rope.dimension_count=31 is odd: RoPE rotates pairs"),
    ("glm-dsa.leading_dense_block_count", -1, "glm-dsa.leading_dense_block_count=-1 is negative"),
    # other u32 keys stored signed: a negative one named no key ('blk.1.ffn_gate_shexp.weight: shape (256, 256)
    # ..., expected (-256, 256)')
    ("glm-dsa.expert_shared_count", -1, "glm-dsa.expert_shared_count=-1 is negative"),
    ("glm-dsa.attention.q_lora_rank", -256, "glm-dsa.attention.q_lora_rank=-256 is negative"),
])
def test_metadata_transformers_rejects_names_its_key(key, value, words, tiny_checkpoint, tmp_path, gguf_rewrite,
                                                      capsys):
    """Before: transformers' own validation error (not a ValueError) came out of verify and generate as a
    traceback that named neither the key nor the file (fresh-user finding)."""
    from gguf import GGUFValueType

    path = gguf_rewrite(tiny_checkpoint, tmp_path / "bad.gguf", set_keys={key: (value, GGUFValueType.INT32)})
    _verify_fail(path, capsys, path.name, words)
    _one_line(["generate", str(path), "--prompt", "Hi", "--max-tokens", "1"], capsys, path.name, words)


def test_any_config_error_from_transformers_is_one_line(tiny_checkpoint, monkeypatch, capsys):
    """Whatever else transformers' ``GlmMoeDsaConfig`` raises becomes one line naming the file, from every command."""
    import transformers

    class StrictError(Exception):  # like huggingface_hub's StrictDataclassClassValidationError: not a ValueError
        pass

    def reject(**kwargs):
        raise StrictError("Class validation error for validator 'x':\n    something is off")

    monkeypatch.setattr(transformers, "GlmMoeDsaConfig", reject)
    words = (tiny_checkpoint.name, "transformers' GlmMoeDsaConfig rejects this metadata: Class validation error "
             "for validator 'x': something is off")
    _verify_fail(tiny_checkpoint, capsys, *words)
    _one_line(["generate", str(tiny_checkpoint), "--prompt", "Hi", "--max-tokens", "1"], capsys, *words)


def test_split_keys_of_the_wrong_type(tiny_checkpoint, tiny_split_checkpoint, tmp_path, gguf_rewrite, capsys):
    """split.count, split.no and split.tensors.count stored as strings: one line naming the key and the file, from
    every command (fresh-user finding: a ValueError traceback from int('three'); split.no '1' was accepted)."""
    from gguf import GGUFValueType

    single = _with_key(tiny_checkpoint, tmp_path / "count.gguf", "split.count", "three", GGUFValueType.STRING)
    words = (single.name, "metadata key split.count is 'three', expected an integer")
    _one_line(["inspect", str(single)], capsys, *words)
    _one_line(["generate", str(single), "--prompt", "Hi"], capsys, *words)
    paths = GGUFModel(tiny_split_checkpoint).paths
    first, second = paths[:2]
    for key, shard in (("split.tensors.count", first), ("split.no", second)):
        d = tmp_path / key
        d.mkdir()
        for p in paths:
            shutil.copy(p, d / p.name)
        value = str(GGUFReader(shard).fields[key].contents())
        gguf_rewrite(shard, d / shard.name, set_keys={key: (value, GGUFValueType.STRING)})
        _one_line(["inspect", str(d / first.name)], capsys, shard.name,
                  f"metadata key {key} is {value!r}, expected an integer")


def test_more_mtp_layers_than_blocks_in_inspect(tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """inspect printed "layers": -6 for nextn_predict_layers above block_count (fresh-user finding)."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "mtp.gguf", set_keys={"glm-dsa.nextn_predict_layers": 10})
    words = (path.name, "glm-dsa.block_count=4 with nextn_predict_layers=10 leaves -6 main layers")
    _one_line(["inspect", str(path), "--json"], capsys, *words)
    _verify_fail(path, capsys, *words)


def test_metadata_without_tensors(tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """A GGUF with the model's metadata and no tensors (fresh-user finding: the message said 'stop at blk.-1')."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "empty.gguf", drop=set(GGUFModel(tiny_checkpoint).tensors))
    words = (path.name, "glm-dsa.block_count=4 but the file's tensors hold no blk.N tensor")
    _verify_fail(path, capsys, *words)
    _one_line(["generate", str(path), "--prompt", "Hi"], capsys, *words)


def test_generate_refuses_what_the_model_cannot_hold(tiny_checkpoint, capsys):
    """A prompt plus --max-tokens past glm-dsa.context_length is refused as vLLM refuses it (max_model_len), not
    run past the trained positions (or into a 51 GB allocation); a seed torch cannot take and a prompt that is not
    UTF-8 are usage errors, not tracebacks."""
    _one_line(["generate", str(tiny_checkpoint), "--prompt", "Hi", "--max-tokens", "600"], capsys,
              tiny_checkpoint.name, "--max-tokens 600 exceeds the model's context length of 512 tokens")
    _one_line(["generate", str(tiny_checkpoint), "--prompt", "the cat sat on the mat. " * 200], capsys,
              "exceeds the model's context length of 512 tokens")
    _one_line(["generate", str(tiny_checkpoint), "--prompt", "bad \udcff\udcfe bytes"], capsys, "not valid UTF-8")
    # 2**32 and up: llama.cpp's seed is 32 bits, and torch's CPU generator sampled 2**32 + 2 as 2 (fresh-user finding)
    for seed in (10**20, 2**32):
        with pytest.raises(SystemExit) as e:
            main(["generate", str(tiny_checkpoint), "--prompt", "Hi", "--seed", str(seed)])
        assert e.value.code == 2 and "--seed" in capsys.readouterr().err
    from glm5serve.reference import ReferenceModel

    model = ReferenceModel.from_gguf(tiny_checkpoint)
    for seed in (2**32 + 2, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"seed must be an integer in 0..2\*\*32-1"):
            next(model.stream([1, 2], 1, greedy=False, seed=seed))
    assert len(list(model.stream([1, 2], 1, greedy=False, seed=np.uint32(2**32 - 1)))) == 1


def test_rows_that_are_not_whole_quant_blocks(tiny_checkpoint, tmp_path, capsys):
    """A quantized tensor's ne[0] must be a multiple of its block size (gguf.cpp); said naming the tensor."""
    path = tmp_path / "rows.gguf"
    shutil.copy(tiny_checkpoint, path)
    r = GGUFReader(path)
    (t,) = [t for t in r.tensors if t.name == "blk.1.attn_k_b.weight"]
    assert t.tensor_type == Q.Q8_0 and int(t.shape[0]) % 32 == 0
    at = t.field.offset + sum(p.nbytes for p in t.field.parts[:3])  # name len, name, n_dims -> ne[0]
    ne0 = int(t.shape[0])
    del r, t
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<Q", ne0 - 1))
    _one_line(["inspect", str(path)], capsys, path.name, "blk.1.attn_k_b.weight",
              f"rows of {ne0 - 1} Q8_0 values are not whole 32-value blocks")


def _tiny_header(path: Path, tensors: list[tuple[str, list[int]]]) -> Path:
    """A GGUF v3 file written byte by byte (gguf-py's writer refuses these): arch glm-dsa, F32 tensors with the
    given ``ne``, consecutive 32-byte-aligned offsets, and 64 zero bytes of data."""
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x.encode())) + x.encode()

    kv = s("general.architecture") + struct.pack("<I", 8) + s("glm-dsa")
    infos, offset = b"", 0
    for name, ne in tensors:
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        infos += struct.pack("<I", int(Q.F32)) + struct.pack("<Q", offset)
        offset += 32
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + kv + infos
    path.write_bytes(body + b"\0" * (-len(body) % 32) + b"\0" * 64)
    return path


@pytest.mark.parametrize("tensors, words", [
    ([("a", [2**62, 3])], "a: ne [4611686018427387904, 3]: the number of values overflows int64"),
    ([("a", [2**32, 2**32])], "a: ne [4294967296, 4294967296]: the number of values overflows int64"),
    ([("a", [8, 1, 1, 1, 1])], "a: 5 dimensions (ne [8, 1, 1, 1, 1]): ggml has at most 4"),
    ([("a", [])], "a: 0 dimensions: gguf-py cannot read a tensor without ne[0]"),
    ([("a", [8]), ("a", [8])], "a: tensor stored twice"),
])
def test_headers_llama_cpp_refuses_are_named_by_tensor(tensors, words, tmp_path, capsys):
    """An overflowing ne read as "truncated file" with no tensor named; 5 dimensions were listed by inspect;
    a tensor stored twice in one file was "header truncated or corrupt", and no dimensions an IndexError in
    gguf-py (fresh-user findings). gguf.cpp (gguf_init_from_file_impl) refuses each."""
    path = _tiny_header(tmp_path / "h.gguf", tensors)
    _one_line(["inspect", str(path)], capsys, f"h.gguf: {words}")


def test_inspect_prints_nothing_before_a_metadata_error(tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    from gguf import GGUFValueType

    path = gguf_rewrite(tiny_checkpoint, tmp_path / "typed.gguf",
                        set_keys={"glm-dsa.expert_count": ("sixteen", GGUFValueType.STRING)})
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert path.name in err and "glm-dsa.expert_count is 'sixteen', expected an integer" in err, err


@pytest.mark.parametrize("value", [float("nan"), 7])
def test_an_architecture_that_is_not_a_string(value, tiny_checkpoint, tmp_path, capsys):
    """A NaN general.architecture made inspect --json print NaN, which strict JSON parsers refuse (fresh-user
    finding); verify refused it already."""
    from gguf import GGUFValueType

    path = _with_key(tiny_checkpoint, tmp_path / "arch.gguf", "general.architecture", value,
                     GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32)
    for json_flag in ([], ["--json"]):
        _one_line(["inspect", *json_flag, str(path)], capsys, "arch.gguf",
                  "metadata key general.architecture is ", ", expected a string")


def test_a_shard_with_the_wrong_split_number(tiny_split_checkpoint, tmp_path, gguf_rewrite, capsys):
    """split.no counts from 0 while file names count from 1: the message gives both."""
    paths = GGUFModel(tiny_split_checkpoint).paths
    for p in paths:
        shutil.copy(p, tmp_path / p.name)
    second = tmp_path / paths[1].name
    gguf_rewrite(paths[1], second, set_keys={"split.no": 2})
    _one_line(["inspect", str(tmp_path / paths[0].name)], capsys, second.name,
              "split.no is 2, but shard 2 of the set needs split.no=1")


def test_a_split_set_without_its_tensor_count(tiny_split_checkpoint, tmp_path, gguf_rewrite, capsys):
    """Shard 1 without split.tensors.count: llama.cpp says "key not found in model"; the message said
    'split.tensors.count=-1', a placeholder (fresh-user finding)."""
    paths = GGUFModel(tiny_split_checkpoint).paths
    for p in paths[1:]:
        shutil.copy(p, tmp_path / p.name)
    first = gguf_rewrite(paths[0], tmp_path / paths[0].name, drop_keys={"split.tensors.count"})
    line = _one_line(["inspect", str(first)], capsys, first.name,
                     "metadata key split.tensors.count is missing from shard 1 of 3")
    assert "-1" not in line.replace(str(first), "")  # the path may hold one (pytest-of-root/pytest-14/...)
    _verify_fail(first, capsys, "split.tensors.count is missing")
    # a count of 0 is there, only wrong: named by its value (a falsy test for "missing" said it was missing)
    zero = gguf_rewrite(paths[0], tmp_path / paths[0].name, set_keys={"split.tensors.count": 0})
    n = len(GGUFModel(tiny_split_checkpoint).tensors)
    _one_line(["inspect", str(zero)], capsys, zero.name, f"split.tensors.count=0 but the 3 files hold {n} tensors")


@pytest.mark.parametrize("edit,words", [({"drop_keys": {"split.count"}}, "metadata key split.count is missing from "
                                                                        "shard 1 of 3"),
                                        ({"set_keys": {"split.count": 0}}, "split.count=0 but the file name says 3")])
def test_a_split_set_without_its_split_count(edit, words, tiny_split_checkpoint, tmp_path, gguf_rewrite, capsys):
    """Shard 1 without split.count (or with 0) was reported as 'split.count=1', a default the file does not hold
    (fresh-user finding)."""
    paths = GGUFModel(tiny_split_checkpoint).paths
    for p in paths[1:]:
        shutil.copy(p, tmp_path / p.name)
    first = gguf_rewrite(paths[0], tmp_path / paths[0].name, **edit)
    assert "split.count=1" not in _one_line(["inspect", str(first)], capsys, first.name, words)
    _verify_fail(first, capsys, words)


def test_a_renamed_shard_is_not_read_as_a_whole_model(tiny_split_checkpoint, tmp_path, gguf_rewrite, capsys):
    """Shard 1 of a 3-file set copied under a plain name holds a third of the tensors; its split.count says so, and
    the file is refused naming that key, not opened as a model of one file."""
    path = tmp_path / "renamed.gguf"
    shutil.copy(tiny_split_checkpoint, path)
    _one_line(["inspect", str(path)], capsys, path.name, "split.count=3 but the file is not named as shard 1 of 3 "
              "(NAME-00001-of-00003.gguf)")
    _verify_fail(path, capsys, path.name, "split.count=3")
    # shard 2 renamed is named as shard 2 (its split.no + 1): renamed as shard 1, llama.cpp and glm5serve refuse it
    second = tmp_path / "second.gguf"
    shutil.copy(GGUFModel(tiny_split_checkpoint).paths[1], second)
    _one_line(["inspect", str(second)], capsys, second.name, "split.count=3 but the file is not named as shard 2 of 3 "
              "(NAME-00002-of-00003.gguf)")
    # a negative count (stored signed; llama.cpp wants u16) is named as such: the line said "shard 1 of -2
    # (NAME-00001-of--0002.gguf)"
    from gguf import GGUFValueType

    for count in (-2, -1):  # -1 too: the largest negative count (a mutant refusing only < -1 was missed)
        negative = gguf_rewrite(tiny_split_checkpoint, tmp_path / f"negative{-count}.gguf",
                                set_keys={"split.count": (count, GGUFValueType.INT16)})
        line = _one_line(["inspect", str(negative)], capsys, negative.name, f"split.count={count} is negative")
        assert "shard" not in line.replace(str(negative), "")  # the test's temp folder is named after it


@pytest.mark.parametrize("bad_merge,words", [("zz qq", "tokenizer.ggml.merges: "),
                                             ("a", "tokenizer.ggml.merges[0] is 'a', not two tokens")])
def test_malformed_merges_are_one_line(bad_merge, words, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """A merge naming a token outside the vocabulary, or not a pair, gave the tokenizers library's traceback in
    ``generate`` (``verify`` already failed it cleanly)."""
    merges = list(GGUFModel(tiny_checkpoint).metadata["tokenizer.ggml.merges"])
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "merges.gguf",
                        set_keys={"tokenizer.ggml.merges": [bad_merge] + merges})
    _one_line(["generate", str(path), "--prompt", "hi"], capsys, path.name, words)
    _verify_fail(path, capsys, words)


def test_a_split_name_that_numbers_no_shard(tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / "z-00000-of-00000.gguf"
    shutil.copy(tiny_checkpoint, path)
    _one_line(["inspect", str(path)], capsys, path.name, "shard 0 of 0: not a split set")


@pytest.mark.parametrize("edit,words", [
    ({"add": {"blk.0.attn_bogus.weight": (np.zeros((4, 256), np.float32), Q.F32)}},
     ("blk.0.attn_bogus.weight", "unknown tensor")),
    # without the MTP count the MTP block's tensors are unknown; the reference used to run them as a main layer
    ({"set_keys": {"glm-dsa.nextn_predict_layers": 0}}, (".nextn.", "unknown tensor")),
    ({"reshape": {"blk.1.ffn_gate_exps.weight": (16, 256, 1, 256)}},
     ("blk.1.ffn_gate_exps.weight", "shape (16, 256, 1, 256) (numpy order), expected (16, 256, 256)")),
])
def test_generate_and_serve_refuse_what_verify_rejects(edit, words, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """generate and serve --dry-run run verify's checks first: a file verify fails is refused with verify's message
    (fresh-user finding: generate printed another continuation, exit 0, for both files)."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "edited.gguf", **edit)
    detail = _verify_fail(path, capsys, *words).split(None, 2)[2]
    for argv in (["generate", str(path), "--prompt", "Hi", "--max-tokens", "1"], ["serve", str(path), "--dry-run"]):
        assert _one_line(argv, capsys).strip() == f"glm5serve {argv[0]}: {detail}"


def test_generate_and_serve_take_ne_padded_with_trailing_ones(tiny_checkpoint, padded_copy, capsys):
    """What llama.cpp loads -- tensors stored with ne [K, N, 1] for [K, N] -- generate and serve take too, and generate
    continues as from the unpadded file (fresh-user finding: refused as a shape error)."""
    runs = []
    for path in (tiny_checkpoint, padded_copy(tiny_checkpoint)):
        assert main(["generate", str(path), "--prompt", "The cat", "--max-tokens", "4"]) == 0
        runs.append(capsys.readouterr().out)
        assert main(["serve", str(path), "--dry-run"]) == 0, capsys.readouterr()
        capsys.readouterr()
    assert runs[0] == runs[1] and runs[0].strip()


@pytest.mark.parametrize("key", ["tokenizer.ggml.merges", "tokenizer.ggml.tokens"])
def test_serve_refuses_a_gguf_without_its_tokenizer(key, tiny_checkpoint, tmp_path, gguf_rewrite, capsys):
    """vLLM builds the tokenizer from the GGUF: serve's pre-flight runs verify's tokenizer check (fresh-user
    finding: --dry-run printed the vLLM command for a file without merges)."""
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "notok.gguf", drop_keys={key})
    detail = _verify_fail(path, capsys, "tokenizer").split(None, 2)[2]
    assert _one_line(["serve", str(path), "--dry-run"], capsys).strip() == f"glm5serve serve: {detail}"
    # with vLLM's --tokenizer or --skip-tokenizer-init the GGUF's is never built, so it need not build (it was
    # checked all the same)
    for extra in (["--tokenizer", "zai-org/GLM-5"], ["--skip_tokenizer_init"]):
        assert main(["serve", str(path), "--dry-run", *extra]) == 0, capsys.readouterr().err
        assert " ".join(extra) in capsys.readouterr().out
    _one_line(["serve", str(path), "--dry-run", "--skip-tokenizer-init", "--no-skip-tokenizer-init"], capsys,
              path.name, "tokenizer")


def test_a_control_character_in_a_file_or_tensor_name_stays_on_the_one_line(tiny_checkpoint, tmp_path, gguf_rewrite,
                                                                             capsys):
    """Fresh-user finding: a newline in a path (a folder named so) or in a tensor name split the one error line in
    two (verify's FAIL line and verdict too); the name is now shown with the newline escaped, as ``\\n``."""
    folder = tmp_path / "new\nline é"
    folder.mkdir()
    missing, file = folder / "missing.gguf", folder / "file"
    file.write_text("")
    shown, shown_file = (str(p).replace("\n", "\\n") for p in (missing, file))
    assert _one_line(["inspect", str(missing)], capsys).strip() == f"glm5serve inspect: {shown}: no such file"
    assert main(["verify", str(missing)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"FAIL  files      {shown}: no such file",
                                                    f"verify: FAILED (0/1 checks passed, TP=1) {shown}"]
    assert _one_line(["make-checkpoint", str(file)], capsys).strip() == (
        f"glm5serve make-checkpoint: {shown_file}: not a directory")
    path = gguf_rewrite(tiny_checkpoint, tmp_path / "t.gguf", add={"blk.0.odd\nname": (np.ones(32, np.float32), Q.F32)})
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert all(line.startswith(("PASS", "FAIL", "verify:")) for line in out.splitlines()), out
    _verify_fail(path, capsys, "blk.0.odd\\nname: unknown tensor")


def test_one_line_escapes_every_character_a_line_breaks_at_and_keeps_the_rest():
    """``errors.one_line`` escapes each character ``str.splitlines`` breaks a line at (``\\x0b``, ``\\x1c``..
    ``\\x1e``, ``\\x85``, ``\\u2028``, ``\\u2029`` as well as ``\\n`` and ``\\r``) and the other C0 controls and
    DEL, and keeps other characters, non-ASCII included (mutants dropping ``\\x85\\u2028\\u2029`` or ``\\x10``-``\\x1f``
    from its pattern were missed: the tests named a newline only)."""
    from glm5serve.errors import GGUFModelError, one_line

    breaks = "".join(c for c in map(chr, range(0x3000)) if len(f"a{c}b".splitlines()) > 1)
    controls = "".join(map(chr, range(0x20))) + "\x7f"
    for c in set(breaks + controls):
        shown = one_line(f"a{c}b")
        assert shown == f"a{repr(c)[1:-1]}b" and shown != f"a{c}b" and len(shown.splitlines()) == 1, \
            (hex(ord(c)), shown)
    assert one_line("é ü\u00a0€ x/y") == "é ü\u00a0€ x/y"
    assert str(GGUFModelError("bad", file="f\u2028g", tensor="t\x85u")) == "f\\u2028g: t\\x85u: bad"


def test_a_metadata_array_longer_than_the_file_is_refused_not_read_for_ever(tiny_checkpoint, tmp_path):
    """Fresh-user finding: an array of numbers whose count is garbled (here tokenizer.ggml.token_type's, to 2**60)
    made gguf-py read it element by element to the end of the file, its memory growing -- 20 s for this 8 MB file,
    hours for a 50 GB shard, for ever where the elements end on the file's end (a UINT8 array: reads past it are
    empty) -- and then say "When changing to a larger dtype..."; gguf.cpp's read fails at the end of the file. It
    is refused at once, in one line naming the file and the count."""
    path = tmp_path / "garbled.gguf"
    shutil.copy(tiny_checkpoint, path)
    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.token_type"]
    offset = f.offset + sum(p.nbytes for p in f.parts[:4])  # key length, key, value type, element type -> count
    del r
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<Q", 2**60))
    for command, rc in (("inspect", 2), ("verify", 1)):  # in a child: without the check it never ends
        proc = subprocess.run([sys.executable, "-m", "glm5serve.cli", command, str(path)], capture_output=True,
                              text=True, timeout=60)
        lines = proc.stderr.splitlines() if command == "inspect" else [x for x in proc.stdout.splitlines()
                                                                         if x.startswith("FAIL")]
        assert proc.returncode == rc and len(lines) == 1 and "Traceback" not in proc.stderr, proc
        assert f"{path}: not a readable GGUF file: header truncated or corrupt: the file is " in lines[0]
        assert f"(a metadata array declares {2**60} INT32 values, more than the " in lines[0], lines[0]


@pytest.mark.parametrize("itype,fmt", [(5, "i"), (10, "Q")])  # INT32, UINT64
def test_a_metadata_array_that_ends_on_the_end_of_the_file_is_read_and_one_value_more_is_refused(itype, fmt,
                                                                                                  tmp_path):
    """The size guard of ``gguf_file._Reader._get_field_parts`` at its edge: an array whose values end exactly on the
    file's last byte is read (here the last thing in a file of no tensors); one value more is refused, naming the
    bytes left after the array's 12-byte element type and count (mutants ``>=`` for ``>``, ``- 4`` for ``- 12`` and
    a count not scaled by the element size were missed: the 2**60 count above is refused by any of them)."""
    from glm5serve.errors import GGUFModelError
    from glm5serve.gguf_file import _open_reader

    def write(name: str, count: int) -> Path:
        key = b"general.some_array"
        header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
        (tmp_path / name).write_bytes(header + struct.pack("<IIQ", 9, itype, count)
                                      + struct.pack(f"<5{fmt}", *range(5)))
        return tmp_path / name

    assert list(_open_reader(write("fits.gguf", 5)).fields["general.some_array"].contents()) == [0, 1, 2, 3, 4]
    with pytest.raises(GGUFModelError) as err:
        _open_reader(write("over.gguf", 6))
    name = {5: "INT32", 10: "UINT64"}[itype]
    size = struct.calcsize(f"<5{fmt}")
    assert str(err.value).endswith(f"(a metadata array declares 6 {name} values, more than the {size} bytes left in "
                                   "the file hold)"), err.value
