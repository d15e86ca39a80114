"""The ``glm5serve`` command line: make-checkpoint, inspect (table and JSON), verify, the default model, and the
sub-command registry."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from glm5serve import cli
from glm5serve.cli import build_parser, main


def test_make_checkpoint_writes_a_split_set(tmp_path, capsys):
    assert main(["make-checkpoint", str(tmp_path), "--preset", "tiny", "--mix", "f32", "--split", "2",
                 "--seed", "3"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == str(tmp_path / "glm5-tiny-f32-s3-00001-of-00002.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["glm5-tiny-f32-s3-00001-of-00002.gguf",
                                                          "glm5-tiny-f32-s3-00002-of-00002.gguf"]
    assert main(["verify", printed]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verify: OK")


def test_make_checkpoint_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make-checkpoint", str(tmp_path), "--preset", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path), "--split", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--split must be >= 1" in err
    assert main(["make-checkpoint", str(tmp_path), "--split", "200"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot split" in err and "into 200 files" in err
    assert main(["make-checkpoint", ""]) == 2  # wrote into the current directory (fresh-user finding)
    assert capsys.readouterr().err.strip() == "glm5serve make-checkpoint: empty path: name the directory to write into"


def test_make_checkpoint_keeps_an_existing_checkpoint_unless_forced(tmp_path, capsys):
    # it overwrote the file silently, where synthetic-gguf asks for --force (fresh-user finding)
    args = ["make-checkpoint", str(tmp_path), "--mix", "f32", "--split", "2"]
    second = tmp_path / "glm5-tiny-f32-00002-of-00002.gguf"
    second.write_bytes(b"not this run's")
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == f"glm5serve make-checkpoint: {second}: exists (--force overwrites it)"
    assert second.read_bytes() == b"not this run's" and len(list(tmp_path.iterdir())) == 1
    assert main([*args, "--force"]) == 0
    assert main(["verify", capsys.readouterr().out.strip().splitlines()[-1]]) == 0
    assert GGUFReader(second).tensors  # rewritten as a shard
    # a directory in the way is never replaced, --force or not
    (tmp_path / "glm5-tiny-f32.gguf").mkdir()
    assert main(["make-checkpoint", str(tmp_path), "--mix", "f32", "--force"]) == 2
    assert capsys.readouterr().err.strip() == f"glm5serve make-checkpoint: {tmp_path / 'glm5-tiny-f32.gguf'}: " \
                                              "exists and is not a regular file (--force replaces only files and links)"


def _make_checkpoint_writing(out: Path) -> subprocess.Popen:
    """``glm5serve make-checkpoint OUT --preset narrow --mix f32`` in a child process, returned once the GGUF is being
    written into its temporary folder (stderr piped as text)."""
    import glm5serve

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(glm5serve.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "glm5serve.cli", "make-checkpoint", str(out), "--preset", "narrow",
                             "--mix", "f32"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while not any(f.is_file() for f in out.glob(".glm5serve-*/*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_sigterm_and_an_unwritable_folder_leave_no_temporary_folder(tmp_path, monkeypatch, capsys):
    """SIGTERM (timeout, docker stop) killed make-checkpoint with its hidden .glm5serve-* folder and a partial GGUF
    left behind; a folder that cannot be written was reported by the temporary folder's name (review findings)."""
    out = tmp_path / "ck"
    proc = _make_checkpoint_writing(out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert list(out.iterdir()) == []

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("tempfile.mkdtemp", refused)
    assert main(["synthetic-gguf", str(tmp_path / "h.gguf"), "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == f"glm5serve synthetic-gguf: {tmp_path}: cannot write here (Operation " \
                                              "not permitted)"


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path, capsys):
    """SIGKILL (or an OOM kill) during make-checkpoint left its hidden folder with a partial GGUF, and nothing ever
    removed it (session 41 left-alone item): the next run into that folder removes it, and only it: a folder of a
    process still running or of another host is kept."""
    import socket

    from glm5serve.checkpoint import _tmp_prefix

    out = tmp_path / "ck"
    proc = _make_checkpoint_writing(out)
    proc.kill()
    proc.communicate(timeout=60)
    host = _tmp_prefix()
    assert host.startswith(f".glm5serve-{socket.gethostname().replace('-', '_')}")
    (orphan,) = out.glob(f"{host}{proc.pid}-*")
    live = out / f"{host}{os.getppid()}-abcdefgh"
    elsewhere = out / f".glm5serve-other_host-{proc.pid}-abcdefgh"
    for d in (live, elsewhere):
        d.mkdir()
    assert main(["make-checkpoint", str(out), "--mix", "f32"]) == 0
    capsys.readouterr()
    assert not orphan.exists() and live.is_dir() and elsewhere.is_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, elsewhere.name, "glm5-tiny-f32.gguf"])


def test_only_a_dead_runs_own_temporary_folder_is_removed(tmp_path):
    """The clean-up takes nothing it did not make: a name that only looks like one (a non-ASCII digit was a
    'invalid literal for int()' error that stopped make-checkpoint; a user's '.glm5serve-HOST-PID-notes' folder was
    deleted), a symbolic link, another user's folder. A PID above any pid_max is never a live process."""
    from glm5serve.checkpoint import _remove_orphans, _tmp_prefix

    pre, dead = _tmp_prefix(), 99999999
    orphan = tmp_path / f"{pre}{dead}-ab_12xyz"
    kept = [tmp_path / f"{pre}\u00b2-abcdefgh", tmp_path / f"{pre}{dead}-notes", tmp_path / f"{pre}{dead}-abcdefgh-x",
            tmp_path / f"{pre}{dead}-ABCDEFGH", tmp_path / f"{pre}{dead}-other123"]
    for d in (orphan, *kept):
        d.mkdir()
        (d / "data").write_text("x")
    if os.geteuid() == 0:
        os.chown(kept[-1], 1000, 1000)
    else:  # a normal user cannot give a folder away
        kept.pop()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f"{pre}{dead}-linkabcd"
    link.symlink_to(target)
    _remove_orphans(tmp_path)
    assert not orphan.exists() and all((d / "data").is_file() for d in kept)
    assert link.is_symlink() and (target / "keep").is_file()


def test_a_run_in_another_pid_namespace_keeps_a_live_runs_folder(tmp_path):
    """Two containers with one host name (``--network host``) writing into one folder: a PID of the other container
    is no process here, so its live run's folder was deleted under it; the folder name now carries the PID
    namespace, and a run in another namespace leaves it alone."""
    import glm5serve
    from glm5serve.checkpoint import replacing

    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here (unshare)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(glm5serve.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    code = ("from pathlib import Path; from glm5serve.checkpoint import _remove_orphans; "
            f"_remove_orphans(Path({str(tmp_path)!r}))")
    with replacing([tmp_path / "model.gguf"]) as (tmp,):
        tmp.write_bytes(b"partial")
        subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], env=env, check=True)
        assert tmp.is_file()
    assert (tmp_path / "model.gguf").read_bytes() == b"partial"


def test_inspect_json_agrees_with_gguf_py(tiny_split_checkpoint, capsys):
    assert main(["inspect", "--json", str(tiny_split_checkpoint)]) == 0
    got = json.loads(capsys.readouterr().out)
    readers = [GGUFReader(p) for p in got["summary"]["files"]]
    tensors = [t for r in readers for t in r.tensors]
    assert [t["name"] for t in got["tensors"]] == [t.name for t in tensors]
    assert [t["shape"] for t in got["tensors"]] == [[int(x) for x in reversed(t.shape)] for t in tensors]
    assert [t["type"] for t in got["tensors"]] == [t.tensor_type.name for t in tensors]
    s = got["summary"]
    assert len(s["files"]) == 3 and s["tensors"] == len(tensors) == 94
    assert s["parameters"] == sum(int(np.prod(t.shape)) for t in tensors)
    assert s["bytes"] == sum(int(t.n_bytes) for t in tensors) == sum(s["bytes_per_type"].values())
    assert sum(s["tensors_per_type"].values()) == 94
    assert (s["layers"], s["mtp_layers"], s["experts"], s["experts_used"], s["shared_experts"]) == (3, 1, 16, 2, 1)


def test_inspect_table_lists_every_tensor(tiny_checkpoint, capsys):
    assert main(["inspect", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    for t in GGUFReader(tiny_checkpoint).tensors:
        assert t.name in out
    assert "summary" in out and "16 routed (top-2) + 1 shared" in out and "3 + 1 MTP" in out
    # shapes as numpy gives them (outermost first), and the header says so: llama.cpp's ne lists them reversed
    name = "blk.0.ffn_down.weight"
    ne = [int(n) for n in next(t for t in GGUFReader(tiny_checkpoint).tensors if t.name == name).shape]
    (row,) = [line for line in out.splitlines() if f" {name} " in line]
    assert ne[0] != ne[1] and " x ".join(map(str, reversed(ne))) in row and "shape (numpy order)" in out, row


def test_inspect_summary_counts_one_tensor_in_the_singular(tiny_checkpoint, monkeypatch, capsys):
    import glm5serve.inspect_cmd as ic

    real = ic.summarize

    def one_f32(model):
        s = real(model)
        return {**s, "tensors_per_type": {**s["tensors_per_type"], "F32": 1}}

    monkeypatch.setattr(ic, "summarize", one_f32)
    assert main(["inspect", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "in 1 tensor " in out and "in 1 tensors" not in out and "in 7 tensors" in out


def test_no_model_means_the_embedded_default(tiny_checkpoint, monkeypatch, capsys):
    calls = []

    def default():
        calls.append(1)
        return tiny_checkpoint

    monkeypatch.setattr("glm5serve.cache.default_checkpoint", default)
    assert main(["inspect", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["files"] == [str(tiny_checkpoint)]
    assert main(["verify"]) == 0
    assert str(tiny_checkpoint) in capsys.readouterr().out.splitlines()[-1]
    assert len(calls) == 2


def test_verify_tp_option(tiny_checkpoint, capsys):
    assert main(["verify", str(tiny_checkpoint), "--tp", "8"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  tp" in out and out.splitlines()[-1].startswith("verify: FAILED (6/7 checks passed, TP=8)")
    assert main(["verify", str(tiny_checkpoint), "--tp", "0"]) == 2


def test_missing_command_modules_are_skipped(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", {**cli.COMMAND_MODULES, "nope": "glm5serve.no_such_command"})
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"make-checkpoint", "inspect", "verify"} <= set(commands)


def test_a_broken_command_module_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "glm5serve_broken_cmd.py").write_text("import glm5serve_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", {"broken": "glm5serve_broken_cmd"})
    with pytest.raises(ModuleNotFoundError, match="glm5serve_dependency_that_is_missing"):
        build_parser()


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_unwritable_output_paths_are_one_line(tmp_path, capsys):
    """make-checkpoint / synthetic-gguf into a path that is a file, a directory or under /proc: exit 2, one line."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    adir = tmp_path / "adir.gguf"
    adir.mkdir()
    for argv in (["make-checkpoint", str(afile), "--preset", "tiny"], ["synthetic-gguf", str(adir), "--preset", "tiny"],
                 ["synthetic-gguf", "/proc/no/such.gguf", "--preset", "tiny"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"glm5serve {argv[0]}: ") and err.strip().count("\n") == 0, err
    # make-checkpoint OUT_DIR that is a file or a dangling link said only "File exists" (fresh-user finding)
    dangling = tmp_path / "dangling"
    dangling.symlink_to("nowhere")
    for out in (afile, dangling):
        assert main(["make-checkpoint", str(out), "--mix", "f32"]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve make-checkpoint: {out}: not a directory"


def test_synthetic_gguf_refuses_a_split_shard_name(tmp_path, capsys):
    """A header written as x-00001-of-00002.gguf is one file that every reader opens as shard 1 of a 2-file set,
    then fails on the missing shard 2 (fresh-user finding): refused before writing, in one line."""
    out = tmp_path / "x-00001-of-00002.gguf"
    assert main(["synthetic-gguf", str(out), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"glm5serve synthetic-gguf: {out}: named like a shard of a split set " \
                          "(...-0000k-of-0000n.gguf); a synthetic header is one file: choose another name"
    assert not out.exists()
    # shard 1 of 1 is the whole set: every reader opens it as the one file it is
    whole = tmp_path / "x-00001-of-00001.gguf"
    assert main(["synthetic-gguf", str(whole), "--preset", "tiny"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", str(whole)]) == 0 and "glm-dsa" in capsys.readouterr().out


def test_force_replaces_a_link_never_its_target(tmp_path, capsys):
    """--force wrote through a symbolic link (a text file it pointed at became a GGUF), and synthetic-gguf wrote
    through a dangling link, creating its target (fresh-user findings): the name itself is replaced."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "glm5-tiny-f32.gguf").symlink_to(precious)
    (tmp_path / "h.gguf").symlink_to(precious)
    (tmp_path / "d.gguf").symlink_to("nowhere.gguf")
    assert main(["make-checkpoint", str(out), "--mix", "f32"]) == 2
    assert "exists (--force overwrites it)" in capsys.readouterr().err
    for argv in (["make-checkpoint", str(out), "--mix", "f32"], ["synthetic-gguf", str(tmp_path / "h.gguf")],
                 ["synthetic-gguf", str(tmp_path / "d.gguf")]):
        assert main([*argv, "--preset", "tiny", "--force"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert precious.read_text() == "keep me" and not (tmp_path / "nowhere.gguf").exists()
    for f in (out / "glm5-tiny-f32.gguf", tmp_path / "h.gguf", tmp_path / "d.gguf"):
        assert not f.is_symlink() and f.read_bytes()[:4] == b"GGUF", f
    assert sorted(p.name for p in out.iterdir()) == ["glm5-tiny-f32.gguf"]  # no temporary folder left
    # a FIFO or a device node of that name is never replaced, --force or not (7de7dc6 replaced them: review finding)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for force in ([], ["--force"]):
        assert main(["synthetic-gguf", str(fifo), "--preset", "tiny", *force]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve synthetic-gguf: {fifo}: exists and is not a regular " \
                                                  "file (--force replaces only files and links)"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert main(["synthetic-gguf", str(tmp_path / "d2.gguf"), "--preset", "tiny"]) == 0  # a plain new name
    (tmp_path / "d3.gguf").symlink_to("nowhere3.gguf")
    assert main(["synthetic-gguf", str(tmp_path / "d3.gguf"), "--preset", "tiny"]) == 2  # without --force: kept
    assert "exists (--force overwrites it)" in capsys.readouterr().err and not (tmp_path / "nowhere3.gguf").exists()


def test_force_keeps_the_replaced_files_mode_and_owner(tmp_path, capsys):
    """A file replaced by --force came back with default permissions and the current owner (session 41 left-alone
    item): it keeps its permission bits, and its owner and group where the user may set them (root here)."""
    out = tmp_path / "h.gguf"
    assert main(["synthetic-gguf", str(out), "--preset", "tiny"]) == 0
    os.chmod(out, 0o640)
    if os.geteuid() == 0:
        os.chown(out, 4321, 4322)
    assert main(["synthetic-gguf", str(out), "--preset", "tiny", "--layers", "2", "--force"]) == 0
    st = out.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and out.read_bytes()[:4] == b"GGUF"
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (4321, 4322)
    # a new name gets the umask's permissions, not some earlier file's
    assert main(["synthetic-gguf", str(tmp_path / "new.gguf"), "--preset", "tiny"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.gguf").lstat().st_mode) == 0o666 & ~umask
    capsys.readouterr()


def test_force_keeps_the_group_where_the_owner_cannot_be_kept(tmp_path):
    """A user who may not give the file back to its owner still may give it the group it had (one of theirs, as
    ``cp -p`` does): a file of a shared group came back in the caller's own group, so the group lost access. Run as
    root without CAP_CHOWN, in supplementary group 4322."""
    import glm5serve

    if os.geteuid() != 0 or subprocess.run(["setpriv", "--groups", "4322", "--bounding-set", "-chown", "true"],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and setpriv to run without CAP_CHOWN in another group")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    os.chown(out, 4321, 4322)
    os.chmod(out, 0o664)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(glm5serve.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    code = ("from pathlib import Path; from glm5serve.checkpoint import replacing\n"
            f"with replacing([Path({str(out)!r})]) as (t,):\n    t.write_bytes(b'new')")
    subprocess.run(["setpriv", "--groups", "4322", "--bounding-set", "-chown", "--inh-caps=-all", sys.executable,
                    "-c", code], env=env, check=True)
    st = out.lstat()
    assert out.read_bytes() == b"new" and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 4322, 0o664)


def test_generate_options_are_checked(capsys):
    for bad in (["--temperature", "nan"], ["--temperature", "-1"], ["--qa-kv-norm-eps", "foo"],
                ["--qa-kv-norm-eps", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "hi", *bad])
        assert e.value.code == 2
        assert f"error: argument {bad[0]}: " in capsys.readouterr().err


def test_generate_logprobs_beyond_the_vocabulary(tiny_checkpoint, capsys):
    assert main(["generate", str(tiny_checkpoint), "--prompt", "hi", "--max-tokens", "1", "--logprobs", "100000"]) == 2
    assert "exceeds the vocabulary" in capsys.readouterr().err


def test_synthetic_layers_beyond_the_model(tmp_path, capsys):
    assert main(["synthetic-gguf", str(tmp_path / "x.gguf"), "--layers", "100"]) == 2
    assert "glm5 has 78 main layers" in capsys.readouterr().err


def test_a_command_imports_only_its_own_module(tiny_checkpoint):
    """`glm5serve inspect` reads a GGUF header: it must not pay for importing torch or transformers (seconds each),
    which other commands' modules and a transformers config at import time used to pull in."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io; from glm5serve.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): rc = main(['inspect', {str(tiny_checkpoint)!r}])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers', 'glm5serve.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "0 []", out
    assert set(build_parser("inspect")._subparsers._group_actions[0].choices) == {"inspect"}


def test_help_shows_no_rest_markup():
    """Sub-command descriptions are taken from docstrings; ``--help`` must not print their reST markup."""
    for name, p in build_parser()._subparsers._group_actions[0].choices.items():
        text = p.format_help()
        assert "``" not in text and ":mod:" not in text and ":func:" not in text, (name, text)


def test_verify_engine_vllm_says_what_it_needs_first(tiny_checkpoint, monkeypatch, capsys):
    """On a machine without a GPU (this one), or without vLLM, ``verify --engine vllm`` says so in one line before
    any check runs, not with a fragment of a vLLM traceback after the static checks."""
    import importlib.util

    assert main(["verify", str(tiny_checkpoint), "--engine", "vllm"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "needs 1 CUDA GPU(s), 0 visible" in err, (out, err)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["verify", str(tiny_checkpoint), "--engine", "vllm"]) == 2
    assert "vLLM is not installed: pip install 'glm5serve[vllm]'" in capsys.readouterr().err


def test_python_dash_m_and_version():
    import subprocess
    import sys

    import glm5serve

    proc = subprocess.run([sys.executable, "-m", "glm5serve", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"glm5serve {glm5serve.__version__}", proc
    proc = subprocess.run([sys.executable, "-m", "glm5serve", "frobnicate"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


def test_every_option_has_help_text():
    """``glm5serve CMD --help`` explains every argument of every sub-command (session 33's fresh-user pass found
    make-checkpoint's --preset / --mix / --seed, synthetic-gguf's --mix and five bench options without any)."""
    import argparse

    from glm5serve.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [f"{name} {' / '.join(a.option_strings) or a.dest}" for name, p in sub.choices.items()
            for a in p._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert len(sub.choices) >= 7 and not bare, bare


def test_synthetic_gguf_keeps_an_existing_file(tiny_checkpoint, tmp_path, capsys):
    """An existing OUT is refused unless --force (fresh-user finding: a real checkpoint's weights were replaced by a
    hole, exit 0); a folder that does not exist is refused, not created."""
    import shutil

    real = tmp_path / "real.gguf"
    shutil.copy(tiny_checkpoint, real)
    before = real.read_bytes()
    assert main(["synthetic-gguf", str(real), "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == f"glm5serve synthetic-gguf: {real}: exists (--force overwrites it)"
    assert real.read_bytes() == before
    assert main(["synthetic-gguf", str(real), "--preset", "tiny", "--force"]) == 0
    assert real.read_bytes() != before
    missing = tmp_path / "no" / "such" / "x.gguf"
    assert main(["synthetic-gguf", str(missing), "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"synthetic-gguf: {missing.parent}: no such directory")
    assert not missing.parent.exists()
    assert main(["synthetic-gguf", str(real / "x.gguf"), "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"synthetic-gguf: {real}: not a directory")
