"""``glm5serve serve``: resolved settings, the vLLM command it hands over to, the weight memory estimate."""
from __future__ import annotations

import sys

import pytest

from glm5serve.cli import main
from glm5serve.vllm_plugin import serve


def test_dry_run_prints_settings_and_the_vllm_command(tiny_split_checkpoint, capsys):
    rc = main(["serve", str(tiny_split_checkpoint), "--tensor-parallel-size", "2", "--max-model-len", "512",
               "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tensor parallel: 2 (checked" in out and "3 files" in out and "Q4_K" in out and "weights per GPU: ~" in out
    assert "the MTP block, which vLLM loads only for speculative decoding, not counted" in out  # the estimate omits it
    cmd = f"{sys.executable} -m vllm.entrypoints.cli.main serve {tiny_split_checkpoint} --tensor-parallel-size 2 " \
          "--max-model-len 512"
    assert out.rstrip().endswith(cmd)


def test_serve_execs_vllms_server_with_the_arguments_unchanged(tiny_checkpoint, monkeypatch, capsys):
    import torch

    calls = []
    monkeypatch.setattr(serve.os, "execv", lambda exe, argv: calls.append((exe, argv)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # as on a 4-GPU host
    main(["serve", str(tiny_checkpoint), "-tp", "4", "--attention-backend", "FLASHMLA_SPARSE", "--port", "8001"])
    assert calls == [(sys.executable, [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                                       str(tiny_checkpoint), "-tp", "4", "--attention-backend", "FLASHMLA_SPARSE",
                                       "--port", "8001"])]
    assert "attention backend: FLASHMLA_SPARSE (--attention-backend)" in capsys.readouterr().out


def test_serve_help_says_how_tp_reaches_vllm():
    """Fresh-user finding: ``serve --help`` said every vLLM argument is passed on unchanged, but ``--tp N`` (the
    spelling glm5serve's other commands take, which vLLM refuses) reaches vLLM as ``--tensor-parallel-size N``."""
    from glm5serve.cli import build_parser

    command = next(a for a in build_parser("serve")._actions if a.dest == "command")
    (args,) = [a for a in command.choices["serve"]._actions if a.dest == "vllm_args"]
    assert "but --tp N as --tensor-parallel-size N" in args.help and "--tp N" in serve.__doc__


def test_a_tp_verify_rejects_is_refused_with_its_message(tiny_checkpoint, capsys):
    from glm5serve.verify import verify

    assert main(["serve", str(tiny_checkpoint), "--tensor-parallel-size=8", "--dry-run"]) == 2
    detail = next(c.detail for c in verify(tiny_checkpoint, 8) if not c.ok)
    assert capsys.readouterr().err.strip() == f"glm5serve serve: {detail}"


def test_without_a_model_only_the_model_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--dry-run"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith("error: the following arguments are required: model")


@pytest.mark.parametrize("args", [["--tensor-parallel-size=0"], ["-tp", "-1"], ["-tp", "two"]])
def test_a_tp_size_that_is_not_a_positive_integer_is_refused(tiny_checkpoint, capsys, args):
    assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("glm5serve serve: --tensor-parallel-size must be ") and not captured.out
    assert captured.err.strip().count("\n") == 0


@pytest.mark.parametrize("var,value", [("GLM5SERVE_GGUF_KERNELS", "off"), ("GLM5SERVE_PDL", "bogus"),
                                       ("GLM5SERVE_SPLIT_Q6_K", "false")])
def test_a_kernel_setting_it_does_not_take_is_refused(tiny_checkpoint, monkeypatch, capsys, var, value):
    """Fresh-user finding: GLM5SERVE_GGUF_KERNELS=off or GLM5SERVE_SPLIT_Q6_K=false silently kept the default
    (the opposite of what was meant), GLM5SERVE_PDL=bogus failed only at vLLM's first kernel launch."""
    monkeypatch.setenv(var, value)
    assert main(["serve", str(tiny_checkpoint), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.strip().count("\n") == 0
    assert captured.err.startswith(f"glm5serve serve: ${var}={value!r}: expected one of "), captured.err


@pytest.mark.parametrize("env,shown", [({}, "glm5serve's Triton kernels (PDL wait on sm_90+; Q4_0/Q5_0/Q8_0/Q6_K "),
                                       ({"GLM5SERVE_SPLIT_Q6_K": "0", "GLM5SERVE_PDL": " OFF"},
                                        "glm5serve's Triton kernels (PDL off on sm_90+; Q4_0/Q5_0/Q8_0 linear"),
                                       ({"GLM5SERVE_GGUF_KERNELS": "Plugin"}, "vllm-gguf-plugin's")])
def test_dry_run_says_which_kernels_run(tiny_checkpoint, monkeypatch, capsys, env, shown):
    for var in ("GLM5SERVE_GGUF_KERNELS", "GLM5SERVE_PDL", "GLM5SERVE_SPLIT_Q6_K"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(["serve", str(tiny_checkpoint), "--dry-run"]) == 0
    assert f"GGUF kernels: {shown}" in capsys.readouterr().out


@pytest.mark.parametrize("capability, topk, want", [
    (None, 2048, "none: no CUDA GPU"), ((9, 0), 2048, "FLASH_ATTN_MLA_SPARSE or FLASHMLA_SPARSE"),
    ((10, 0), 2048, "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE"), ((12, 0), 2048, "FLASHINFER_MLA_SPARSE_SM120"),
    ((12, 0), 8, "CUSTOM (glm5serve's Triton MLA"), ((8, 0), 2048, "CUSTOM (glm5serve's Triton MLA"),
    ((7, 5), 2048, "needs SM80")])
def test_attention_backend_by_gpu(capability, topk, want):
    assert want in serve.attention_backend(topk, None, capability)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_weight_memory_estimate_matches_what_a_rank_holds(tiny_checkpoint, tp):
    """Within 5% of the bytes of every parameter vLLM's model holds on rank 0 after a CPU load."""
    pytest.importorskip("vllm")
    from glm5serve.config import config_from_metadata
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.vllm_plugin.cpu import build_and_load

    model, _ = build_and_load(tiny_checkpoint, tp=tp)
    held = 0
    for p in model.parameters():
        held += sum(t.nbytes for t in p.data_container) if getattr(p, "data_container", None) else p.nbytes
    gguf = GGUFModel(tiny_checkpoint)
    estimate = serve.weight_bytes_per_gpu(gguf, config_from_metadata(gguf), tp)
    assert abs(estimate - held) <= 0.05 * held, (estimate, held)


def test_serve_refuses_without_a_gpu_or_with_a_header_and_no_synthetic_format(tiny_checkpoint, tmp_path, capsys):
    """What vLLM would only fail on after a long start is refused in one line (this CPU machine has no GPU)."""
    from glm5serve.synthetic import write_header

    assert main(["serve", str(tiny_checkpoint)]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    header = write_header(tmp_path / "h.gguf", "tiny")
    assert main(["serve", str(header)]) == 2
    err = capsys.readouterr().err
    assert "--load-format glm5-synthetic" in err and err.strip().count("\n") == 0


def test_serve_refuses_real_weights_with_the_synthetic_load_format(tiny_checkpoint, capsys):
    """--load-format glm5-synthetic would replace real weights by random ones without a word: refused, --dry-run
    included, as bench refuses it."""
    for extra in ([], ["--dry-run"]):
        assert main(["serve", str(tiny_checkpoint), "--load-format", "glm5-synthetic", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and tiny_checkpoint.name in err and "needs a header from" in err, err


@pytest.mark.parametrize("args", [["--tensor-parallel-size"], ["-tp", "--enforce-eager"]])
def test_an_option_without_its_value_is_refused(tiny_checkpoint, capsys, args):
    """Fresh-user finding: a trailing --tensor-parallel-size was read as TP 1 and printed into the vLLM command."""
    assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"glm5serve serve: {args[0]} needs a value" and not captured.out


def test_options_are_read_as_vllm_spells_them(tiny_checkpoint, tmp_path, capsys):
    """vLLM reads ``--tensor_parallel_size 3`` as ``--tensor-parallel-size 3`` and takes abbreviations: the TP check
    was skipped for both and TP 1 printed, and a header with ``--load_format glm5-synthetic`` was refused
    (fresh-user finding). Underscores are read as dashes; an abbreviation of a checked option is refused."""
    from glm5serve.synthetic import write_header

    for args in (["--tensor_parallel_size", "3"], ["--tensor_parallel-size=3"], ["--tensor-parallel-size", "3"]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not divide by TP=3" in err, (args, err)
    for args in (["--tensor-parallel", "2"], ["--tensor-parallel=2"]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
        err = capsys.readouterr().err
        assert err.strip() == "glm5serve serve: --tensor-parallel: write --tensor-parallel-size in full (glm5serve " \
                              "checks it before vLLM)", err
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--tensor_parallel_size", "2"]) == 0
    assert "tensor parallel: 2 " in capsys.readouterr().out
    header = write_header(tmp_path / "h.gguf", "tiny")
    assert main(["serve", str(header), "--dry-run", "--load_format", "glm5-synthetic"]) == 0


def test_tp_as_glm5serve_spells_it_is_passed_to_vllm_as_tensor_parallel_size(tiny_checkpoint, capsys):
    """``verify`` and ``bench`` spell it ``--tp``: ``serve --tp 3`` printed TP 1, skipped the TP check and handed
    vLLM a ``--tp`` its parser refuses (fresh-user finding)."""
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--tp", "3"]) == 2
    assert "does not divide by TP=3" in capsys.readouterr().err
    for args in (["--tp", "2"], ["--tp=2"]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 0
        out = capsys.readouterr().out
        assert "tensor parallel: 2 " in out and " --tp" not in out, out
        want = " ".join(args).replace("--tp", "--tensor-parallel-size")
        assert out.rstrip().endswith(f"serve {tiny_checkpoint} {want}"), out


def test_the_printed_command_pastes_into_a_shell(tiny_checkpoint, tmp_path, capsys):
    """A model path with spaces is quoted in the printed vLLM command (fresh-user finding)."""
    import shlex
    import shutil

    spaced = tmp_path / "a dir" / "m odel.gguf"
    spaced.parent.mkdir()
    shutil.copy(tiny_checkpoint, spaced)
    assert main(["serve", str(spaced), "--dry-run", "--max-model-len", "64"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("vLLM:"))
    assert shlex.split(line.split(":", 1)[1])[-4:] == ["serve", str(spaced), "--max-model-len", "64"]


@pytest.mark.parametrize("args,given", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"), (["-pp", "2"], "--pipeline-parallel-size 2"),
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size 2"), (["--pipeline_parallel_size", "4"],
                                                                       "--pipeline-parallel-size 4"),
    (["--enable-expert-parallel"], "--enable-expert-parallel"), (["-ep"], "--enable-expert-parallel"),
    (["--disable-expert-parallel", "--enable_expert_parallel"], "--enable-expert-parallel"),
    (["-pp", "2", "-ep"], "--pipeline-parallel-size 2 or --enable-expert-parallel")])
def test_pipeline_and_expert_parallelism_are_refused_before_vllm_starts(tiny_checkpoint, monkeypatch, capsys, args,
                                                                        given):
    """Tester finding: serve printed and started the vLLM command; glm5serve's loader refused these only inside
    load_model, after vLLM had started its workers on the GPUs. Refused in one line naming the file and the flag,
    with the loader's own words (vllm_plugin.check_parallel)."""
    import torch

    calls = []
    monkeypatch.setattr(serve.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    want = (f"glm5serve serve: {tiny_checkpoint}: glm5serve loads GLM-5 GGUF with tensor parallelism only, not "
            f"{given} (experts load as whole 3-D tensors; every layer must reach each GPU)")
    for extra in (["--dry-run"], []):
        assert main(["serve", str(tiny_checkpoint), *extra, *args]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == want and not captured.out, captured
    assert calls == []


def test_what_the_loader_takes_is_not_refused(tiny_checkpoint, capsys):
    """Pipeline size 1, expert parallelism switched off again and data parallelism load (the loader takes them)."""
    for args in (["-pp", "1"], ["-ep", "--no-enable-expert-parallel"], ["--enable-expert-parallel",
                                                                        "--disable-expert-parallel"], ["-dp", "2"]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.rstrip().endswith(" ".join(args))
    for args, want in ((["-pp", "two"], "--pipeline-parallel-size must be an integer, not 'two'"),
                       (["--pipeline-parallel-size=0"], "--pipeline-parallel-size must be >= 1, not 0"),
                       (["--enable-expert"], "--enable-expert: write --enable-expert-parallel in full (glm5serve "
                                             "checks it before vLLM)")):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve serve: {want}"


def test_the_loader_refuses_pipeline_and_expert_parallelism_in_the_same_words(tiny_checkpoint, capsys):
    """One source of truth: the loader (inside vLLM) and serve's pre-flight say the same."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from glm5serve.errors import GGUFModelError
    from glm5serve.vllm_plugin.loader import _check_parallel

    model_config = SimpleNamespace(model_weights=str(tiny_checkpoint), model=str(tiny_checkpoint))
    for pp, ep, args in ((2, False, ["-pp", "2"]), (1, True, ["-ep"]), (3, True, ["-pp", "3", "-ep"])):
        parallel = SimpleNamespace(pipeline_parallel_size=pp, enable_expert_parallel=ep)
        with pytest.raises(GGUFModelError) as e:
            _check_parallel(SimpleNamespace(parallel_config=parallel), model_config)
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve serve: {e.value}"
    _check_parallel(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1)), model_config)


def test_options_in_a_config_file_are_read_as_vllm_reads_them(tiny_checkpoint, tmp_path, capsys):
    """Tester finding: ``--config tp3.yaml`` holding ``tensor-parallel-size: 3`` was checked as TP=1 (and printed
    TP 1), though vLLM serves at TP=3. vLLM puts the file's keys right after MODEL, so the command line wins."""
    from glm5serve.synthetic import write_header

    def config(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    tp3, tp2 = config("tp3.yaml", "tensor-parallel-size: 3\nport: 8001\n"), config("tp2.yml", "tensor_parallel_size: 2")
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", tp3]) == 2
    assert "does not divide by TP=3" in capsys.readouterr().err
    for args in (["--config", tp2], ["--config", tp3, "-tp", "2"], ["--tensor-parallel-size=2", "--config", tp3]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "tensor parallel: 2 " in out and out.rstrip().endswith(f"serve {tiny_checkpoint} {' '.join(args)}")
    header = write_header(tmp_path / "h.gguf", "tiny")  # every option serve reads comes from the file too
    assert main(["serve", str(header), "--dry-run", "--config", config("f.yaml", "load-format: glm5-synthetic")]) == 0
    capsys.readouterr()
    # pipeline and expert parallelism: refused naming the file they came from; switched off on the command line
    for text, given in (("pipeline-parallel-size: 2", "--pipeline-parallel-size 2"),
                        ("enable-expert-parallel: true", "--enable-expert-parallel")):
        path = config("p.yaml", text)
        assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", path]) == 2
        assert capsys.readouterr().err.startswith(f"glm5serve serve: {path}: glm5serve loads GLM-5 GGUF with tensor "
                                                  f"parallelism only, not {given} (")
    for args in (["-pp", "1"], ["--disable-expert-parallel"]):
        path = config("p.yaml", "pipeline-parallel-size: 2" if args[0] == "-pp" else "enable_expert_parallel: true")
        assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", path, *args]) == 0
    # given on the command line, in any spelling, beside a --config that does not give it: named as the model's
    # (reading only `--name V` as the command line's named the config file for `--name=V`)
    port = config("port.yaml", "port: 8001")
    for args in (["--pipeline-parallel-size=2"], ["--pipeline_parallel_size=2"], ["-pp", "2"]):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", port, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"glm5serve serve: {tiny_checkpoint}: glm5serve loads GLM-5 GGUF with tensor parallelism "
                              "only, not --pipeline-parallel-size 2 ("), (args, err)
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", port, "--tensor-parallel-size=two"]) == 2
    assert capsys.readouterr().err.strip() == "glm5serve serve: --tensor-parallel-size must be an integer, not 'two'"
    # glm5serve's --tp is rewritten on the command line, not in a file vLLM reads itself: it was checked as TP=1,
    # then vLLM stopped on 'unrecognized arguments: --tp 2'
    tp = config("tp.yaml", "tp: 2")
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", tp]) == 2
    assert capsys.readouterr().err.strip() == (f"glm5serve serve: {tp}: --config: vLLM has no option tp (it stops on "
                                               "'unrecognized arguments: --tp'); write tensor-parallel-size (--tp is "
                                               "glm5serve's command-line spelling)")
    off = config("o.yaml", "enable-expert-parallel: false\npipeline-parallel-size: 1")
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", off]) == 0
    # an abbreviated key (vLLM takes `tensor-parallel: 2`) is refused as on the command line, naming the file: the
    # line named no file, so it read as the command line's
    for text, name, full in (("tensor-parallel: 2", "--tensor-parallel", "--tensor-parallel-size"),
                             ("enable_expert: true", "--enable_expert", "--enable-expert-parallel"),
                             ("max-model: 64", "--max-model", "--max-model-len"),
                             ("port: 8001\ntok: x", "--tok", "--tokenizer"),
                             # each other option and flag serve reads (_READ_OPTIONS, _READ_FLAGS): one left out of
                             # the lists was refused later, naming no file (mutants dropping one were missed)
                             ("pipeline-parallel: 1", "--pipeline-parallel", "--pipeline-parallel-size"),
                             ("load: gguf", "--load", "--load-format"),
                             ("chat-temp: x.jinja", "--chat-temp", "--chat-template"),
                             ("attention-back: FLASHMLA", "--attention-back", "--attention-backend"),
                             ("skip_tokenizer: true", "--skip_tokenizer", "--skip-tokenizer-init")):
        short = config("short.yaml", text)
        assert main(["serve", str(tiny_checkpoint), "--dry-run", "--config", short, "-tp", "2"]) == 2
        assert capsys.readouterr().err.strip() == (f"glm5serve serve: {short}: --config: {name}: write {full} in full "
                                                   "(glm5serve checks it before vLLM)"), text


def test_a_config_file_vllm_cannot_use_is_refused_in_one_line(tiny_checkpoint, tmp_path, capsys):
    def config(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    missing = str(tmp_path / "missing.yaml")
    cases = [(["--config", missing], f"{missing}: --config: cannot read it: No such file or directory"),
             (["--config", config("bad.yaml", "tensor-parallel-size: [3\n")], "bad.yaml: --config: not valid YAML: "),
             (["--config", config("list.yaml", "- 3\n")], "list.yaml: --config: not a YAML mapping of vLLM options"),
             (["--config", config("empty.yaml", "")], "empty.yaml: --config: not a YAML mapping of vLLM options"),
             (["--config", config("c.json", "{}")], "c.json: --config must name a .yaml or .yml file"),
             (["--config", config("t.yaml", "tensor-parallel-size: three")],
              "t.yaml: --tensor-parallel-size must be an integer, not 'three'"),
             (["--config", config("m.yaml", "max-model-len: 4KB")],  # named no file (fresh-user finding)
              "m.yaml: --max-model-len must be a number of tokens (4096, 4k, 4K) or auto, not '4KB'"),
             (["--config=" + config("eq.yaml", "port: 1")], "write --config FILE, not --config=FILE: vLLM reads the "
                                                             "file only in that spelling"),
             (["--config", config("a.yaml", "port: 1"), "--config", config("b.yaml", "port: 2")],
              "--config given twice"),
             (["--config"], "--config needs a value")]
    for args, want in cases:
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2, args
        captured = capsys.readouterr()
        assert want in captured.err and captured.err.count("\n") == 1 and not captured.out, (args, captured)


def test_a_max_model_len_above_the_context_length_is_refused(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """vLLM refuses ``--max-model-len`` above the model's max_position_embeddings (the GGUF's context_length, 512
    for the tiny preset) with a traceback, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; serve passed it. vLLM's
    spellings: 1k = 1000, 1K = 1024, -1 or auto = what fits in memory."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    (tmp_path / "long.yaml").write_text("max-model-len: 2048")
    for args, n in ((["--max-model-len", "1024"], 1024), (["--max_model_len=1k"], 1000), (["--max-model-len", "1K"],
                    1024), (["--config", str(tmp_path / "long.yaml")], 2048)):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == (f"glm5serve serve: {tiny_checkpoint}: --max-model-len {n} is above the GGUF's "
                                        "context_length 512 (vLLM's max_position_embeddings; vLLM refuses it unless "
                                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)") and not captured.out, captured
    for args, shown in (([], "512 (the GGUF's context_length; --max-model-len to lower it)"),
                        (["--max-model-len", "0.5k"], "500 (--max-model-len; the GGUF's context_length is 512)"),
                        (["--max-model-len", "-1"], "auto (what fits in GPU memory, at most the GGUF's context_length "
                                                    "512)"), (["--max-model-len=auto"], "auto (")):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", *args]) == 0
        assert f"max model len: {shown}" in capsys.readouterr().out
    for bad in ("abc", "1.5K", "0", "-2"):
        assert main(["serve", str(tiny_checkpoint), "--dry-run", f"--max-model-len={bad}"]) == 2
        assert capsys.readouterr().err.strip() == ("glm5serve serve: --max-model-len must be a number of tokens "
                                                   f"(4096, 4k, 4K) or auto, not {bad!r}")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "true")  # vLLM then takes it (with a warning)
    assert main(["serve", str(tiny_checkpoint), "--dry-run", "--max-model-len", "1024"]) == 0
    assert "max model len: 1024 (--max-model-len; the GGUF's context_length is 512)" in capsys.readouterr().out
