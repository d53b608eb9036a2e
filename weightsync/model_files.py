"""A model directory without its weights (config, tokenizer, chat template, generation config), packed by the learner
and unpacked by a generator on another host, which then needs no shared filesystem: the weights come through
weight sync, and `materialize` writes the version it fetched beside these files, so every engine starts from an
ordinary model directory.

The archive comes from another machine: it is unpacked with tarfile's "data" filter (no absolute paths, no `..`,
no links out, no devices), into a fresh directory, under a size limit, and only its regular files are kept.
"""
import hashlib
import io
import os
import shutil
import tarfile
import tempfile

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Files left out: weights, in any of the formats HF model directories carry."""
MAX_FILES_BYTES = 256 << 20
"""Largest archive packed or accepted: tokenizers and configs weigh a few MB; anything near this is not one."""


class ModelFilesError(RuntimeError):
    """The model directory cannot be packed, or an archive from the learner cannot be trusted or unpacked."""


def pack(model_dir: str) -> tuple[bytes, str]:
    """(a tar of `model_dir`'s top-level non-weight files, its sha256). Sorted and stripped of owners and times, so
    the same files always give the same digest."""
    names = sorted(name for name in os.listdir(model_dir)
                   if os.path.isfile(os.path.join(model_dir, name)) and not name.endswith(WEIGHT_SUFFIXES)
                   and not name.startswith("."))
    if "config.json" not in names:
        raise ModelFilesError(f"{model_dir} has no config.json: not a model directory generators could start from")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name in names:
            with open(os.path.join(model_dir, name), "rb") as handle:
                data = handle.read()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            archive.addfile(info, io.BytesIO(data))
    blob = out.getvalue()
    if len(blob) > MAX_FILES_BYTES:
        raise ModelFilesError(f"{model_dir}'s non-weight files weigh {len(blob)} bytes, over {MAX_FILES_BYTES}")
    return blob, hashlib.sha256(blob).hexdigest()


def unpack(blob: bytes, digest: str, dest: str) -> list[str]:
    """Check `blob` against `digest` and unpack its regular files into `dest` (created; must not exist). Returns
    the file names."""
    if len(blob) > MAX_FILES_BYTES:
        raise ModelFilesError(f"the model files archive is {len(blob)} bytes, over {MAX_FILES_BYTES}")
    if hashlib.sha256(blob).hexdigest() != digest:
        raise ModelFilesError("the model files archive does not match its digest")
    os.makedirs(dest)
    names = []
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as archive:
            for member in archive.getmembers():
                if not member.isfile() or "/" in member.name or member.name.startswith("."):
                    raise ModelFilesError(f"the model files archive holds {member.name!r}, not a top-level file")
                archive.extract(member, dest, filter="data")
                names.append(member.name)
    except (tarfile.TarError, OSError) as err:
        shutil.rmtree(dest, ignore_errors=True)
        raise ModelFilesError(f"the model files archive cannot be unpacked: {err}") from None
    except ModelFilesError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    if "config.json" not in names:
        shutil.rmtree(dest, ignore_errors=True)
        raise ModelFilesError("the model files archive has no config.json")
    return names


def materialize(blob: bytes, digest: str, named_tensors, cache_dir: str, name: str) -> str:
    """A model directory under `cache_dir`: the learner's files and `named_tensors` (a fetched version, HF names) as
    model.safetensors. Written to a temporary name and renamed, so a crash never leaves a half directory that a
    later start would take for a whole one. `name` (the generator's id) keeps generators sharing a cache apart."""
    from safetensors.torch import save_file

    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=cache_dir)
    target = os.path.join(cache_dir, f"{digest[:16]}-{name}")
    try:
        files = os.path.join(staging, "model")
        unpack(blob, digest, files)
        save_file({name: tensor.contiguous().clone() for name, tensor in named_tensors},
                  os.path.join(files, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(target):  # an earlier start's: its weights are an older version, replaced
            shutil.rmtree(target)
        os.rename(files, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
