"""A generator with nothing shared starts from the learner's model files (weightsync/model_files.py): packed
without weights, unpacked only after the digest matches and only as top-level regular files, and written with the
fetched weights into a model directory transformers loads."""
import io
import os
import tarfile

import pytest
import torch

from asyncrl.generator.model_source import uses_local
from asyncrl.weightsync.catchup import CatchupError, CatchupServer, fetch_files
from asyncrl.weightsync.model_files import ModelFilesError, materialize, pack, unpack


def model_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "x"}')
    (directory / "tokenizer.json").write_text('{"vocab": {}}')
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / "pytorch_model.bin").write_bytes(b"weights")
    (directory / ".hidden").write_text("no")
    (directory / "sub").mkdir()
    (directory / "sub" / "x.txt").write_text("no")
    return str(directory)


def archive(members) -> bytes:
    """A tar with `members`: (TarInfo, data) pairs."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def entry(name, data=b"x", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


def test_pack_leaves_weights_out_and_unpack_gives_the_same_files(tmp_path):
    blob, digest = pack(model_dir(tmp_path))
    assert pack(model_dir(tmp_path / "again"))[1] == digest  # deterministic: no owners, no times
    names = unpack(blob, digest, str(tmp_path / "out"))
    assert sorted(names) == ["config.json", "tokenizer.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"vocab": {}}'
    with pytest.raises(ModelFilesError, match="digest"):
        unpack(blob + b"\0", digest, str(tmp_path / "out2"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFilesError, match="config.json"):
        pack(str(tmp_path / "empty"))


@pytest.mark.parametrize("members, error", [
    ([entry("config.json"), entry("../escape")], "not a top-level file"),
    ([entry("config.json"), entry("/etc/passwd")], "not a top-level file"),
    ([entry("config.json"), entry("sub/file")], "not a top-level file"),
    ([entry("config.json"), entry("link", kind=tarfile.SYMTYPE, link="/etc/passwd")], "not a top-level file"),
    ([entry("config.json"), entry(".bashrc")], "not a top-level file"),
    ([entry("tokenizer.json")], "no config.json"),
])
def test_a_hostile_archive_is_refused_and_leaves_nothing(tmp_path, members, error):
    import hashlib

    blob = archive(members)
    with pytest.raises(ModelFilesError, match=error):
        unpack(blob, hashlib.sha256(blob).hexdigest(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape").exists()


def test_materialize_writes_a_model_directory_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.model import build_qwen2

    source = tmp_path / "learner-model"
    model = build_qwen2(64, 32, 1, eos_token_id=1, pad_token_id=0, seed=0)
    model.save_pretrained(source)
    blob, digest = pack(str(source))
    trained = {name: tensor + 1.0 for name, tensor in model.state_dict().items()}  # "a later version"
    path = materialize(blob, digest, trained.items(), str(tmp_path / "cache"), "gen-0")
    assert sorted(os.listdir(tmp_path / "cache")) == [os.path.basename(path)]  # no partial directory left behind
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in trained.items())
    assert materialize(blob, digest, trained.items(), str(tmp_path / "cache"), "gen-0") == path  # replaced in place


def test_the_catch_up_server_serves_the_files_it_was_given(tmp_path):
    server = CatchupServer("127.0.0.1", 0)
    try:
        with pytest.raises(CatchupError, match="serves no model files"):
            fetch_files(server.address, 5)
        blob, digest = pack(model_dir(tmp_path))
        server.serve_files(blob, digest)
        assert fetch_files(server.address, 5) == (blob, digest)
    finally:
        server.close()


def test_the_learners_own_directory_is_used_when_this_host_has_it(tmp_path):
    present = model_dir(tmp_path)
    assert uses_local("auto", present) and uses_local("local", present)
    assert not uses_local("learner", present)  # asked for explicitly: the learner's files even if the path exists
    assert not uses_local("auto", str(tmp_path / "not-here")) and uses_local("local", str(tmp_path / "not-here"))
