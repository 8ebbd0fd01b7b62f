"""`kustomize build` for the kustomize features deploy/k8s uses, and only those.

No kustomize binary is needed (none is installed where the tests run). Anything outside this
subset is refused, not approximated, so what the tests validate is what `kubectl apply -k`
applies:

- `resources`: files (one or more YAML documents) and directories (kustomizations,
  rendered first with their own transformers, as kustomize does);
- `secretGenerator`: `files` (`path` or `key=path`, inside the kustomization's folder) with
  `generatorOptions.disableNameSuffixHash: true` (no hash suffix to compute);
- `patches`: strategic-merge patches from `path`, applied to the Deployments a `target`
  picks (`kind`, `name` as an anchored regular expression); lists merge by their Kubernetes
  patch-merge key (containers and volumes by name, env by name, volumeMounts by mountPath,
  container ports by containerPort), other lists are replaced, a null value deletes;
- `namespace` (the Namespace object itself is renamed, as kustomize does), `labels` (pairs
  on every object's metadata only) and `images` (`newName`, `newTag`), applied in
  kustomize's order: patches, namespace, labels, images.

YAML anchors and aliases are refused: kustomize's parser has not always expanded them.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "secretGenerator",
    "generatorOptions",
    "patches",
    "namespace",
    "labels",
    "images",
}
# kinds whose handling by the namespace, labels and images transformers is known here
KINDS = {
    "Namespace",
    "Secret",
    "Service",
    "Deployment",
    "HorizontalPodAutoscaler",
    "PodMonitor",
    "PodDisruptionBudget",  # the labels transformer (no includeSelectors): metadata only
}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",  # patches apply to Deployments only: container ports
}


class Unsupported(ValueError):
    """A kustomize feature this renderer does not implement."""


def load_documents(path: Path) -> list[Obj]:
    text = path.read_text()
    for event in yaml.parse(text):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise Unsupported(f"{path}: YAML anchors and aliases are not supported")
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def _only(mapping: Obj, allowed: set[str], what: str) -> None:
    extra = set(mapping) - allowed
    if extra:
        raise Unsupported(f"{what}: {sorted(extra)} not supported")


def render(directory: Path) -> list[Obj]:
    [k] = load_documents(directory / "kustomization.yaml")
    _only(k, FIELDS, f"{directory}/kustomization.yaml")
    objects: list[Obj] = []
    for entry in k.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else load_documents(path)
    objects += _generate_secrets(directory, k)
    for patch in k.get("patches", []):
        _apply_patch(directory, patch, objects)
    for obj in objects:
        if obj["kind"] not in KINDS:
            raise Unsupported(f"kind {obj['kind']}: its transformer fields are not known here")
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = k["namespace"]
            else:
                obj["metadata"]["namespace"] = k["namespace"]
    for spec in k.get("labels", []):
        _only(spec, {"pairs"}, "labels")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(spec["pairs"])
    for image in k.get("images", []):
        _only(image, {"name", "newName", "newTag"}, "images")
        for obj in objects:
            for container in _containers(obj):
                container["image"] = _retag(container["image"], image)
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: objects defined twice: {sorted(map(str, duplicates))}")
    return objects


def _generate_secrets(directory: Path, k: Obj) -> list[Obj]:
    generators = k.get("secretGenerator", [])
    if generators and k.get("generatorOptions") != {"disableNameSuffixHash": True}:
        raise Unsupported("secretGenerator needs generatorOptions.disableNameSuffixHash: true")
    secrets = []
    for gen in generators:
        _only(gen, {"name", "type", "files"}, "secretGenerator")
        data = {}
        for entry in gen["files"]:
            key, _, rel = entry.rpartition("=")
            path = (directory / rel).resolve()
            if not path.is_relative_to(directory.resolve()):
                raise ValueError(f"{entry}: outside {directory} (kustomize's load restrictor)")
            if not path.is_file():
                raise FileNotFoundError(f"secretGenerator {gen['name']}: no file {path}")
            data[key or path.name] = base64.b64encode(path.read_bytes()).decode()
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "type": gen.get("type", "Opaque"),
                "data": data,
            }
        )
    return secrets


def _apply_patch(directory: Path, entry: Obj, objects: list[Obj]) -> None:
    _only(entry, {"path", "target"}, "patches")
    _only(entry["target"], {"kind", "name"}, "patches target")
    if entry["target"].get("kind") != "Deployment":
        raise Unsupported("patches target only Deployments here (their merge keys are known)")
    [patch] = load_documents(directory / entry["path"])
    body = {key: value for key, value in patch.items() if key not in ("apiVersion", "kind")}
    body["metadata"] = {k: v for k, v in patch.get("metadata", {}).items() if k != "name"}
    matched = [
        i
        for i, obj in enumerate(objects)
        if obj["kind"] == entry["target"]["kind"]
        and re.fullmatch(entry["target"].get("name", ".*"), obj["metadata"]["name"])
    ]
    if not matched:  # kustomize would apply nothing, silently: a test wants to know
        raise ValueError(f"patch {entry['path']} matches no object")
    for i in matched:
        objects[i] = merge(objects[i], body)


def merge(base: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge of `patch` into `base` (neither is modified)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = copy.deepcopy(base)
        for name, value in patch.items():
            if name.startswith("$"):
                raise Unsupported(f"patch directive {name}")
            if value is None:
                out.pop(name, None)
            else:
                out[name] = merge(out[name], value, name) if name in out else copy.deepcopy(value)
        return out
    merge_key = MERGE_KEYS.get(key)
    if isinstance(patch, list) and isinstance(base, list) and merge_key:
        out = copy.deepcopy(base)
        for item in patch:
            same = [i for i, old in enumerate(out) if old[merge_key] == item[merge_key]]
            if same:
                out[same[0]] = merge(out[same[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _containers(obj: Obj) -> list[Obj]:
    if obj["kind"] != "Deployment":
        return []
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _retag(image: str, rule: Obj) -> str:
    name, tag = image, ""
    if "@" in name:
        raise Unsupported(f"image {image}: digests")
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    tag = rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name
