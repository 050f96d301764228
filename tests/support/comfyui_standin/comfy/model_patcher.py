"""ModelPatcher: the clone / patch / callback surface the node uses."""

import copy

import torch

from comfy.patcher_extension import CallbacksMP


class ModelSampling:
    """Flow-matching sigmas: percent p of sampling -> sigma 1 - p."""

    def percent_to_sigma(self, percent):
        return 1.0 - percent


class ModelPatcher:
    def __init__(self, diffusion_model, model_sampling=None):
        self.diffusion_model = diffusion_model
        self.model_sampling = model_sampling or ModelSampling()
        self.model_options = {"transformer_options": {}}
        self.callbacks = {}

    def clone(self):
        n = ModelPatcher(self.diffusion_model, self.model_sampling)
        n.model_options = copy.copy(self.model_options)
        n.model_options["transformer_options"] = dict(self.model_options["transformer_options"])
        n.callbacks = {t: {k: list(v) for k, v in d.items()} for t, d in self.callbacks.items()}
        return n

    def get_model_object(self, name):
        return getattr(self, name)

    def set_model_patch_replace(self, patch, name, block_name, number):
        to = dict(self.model_options["transformer_options"])
        replace = {k: dict(v) for k, v in to.get("patches_replace", {}).items()}
        replace.setdefault(name, {})[(block_name, number)] = patch
        to["patches_replace"] = replace
        self.model_options["transformer_options"] = to

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def _callbacks(self, call_type):
        return [c for cs in self.callbacks.get(call_type, {}).values() for c in cs]

    def apply_model(self, *inputs, sigma=0.5, **kwargs):
        """One model call at ``sigma``, as the sampler makes it: fresh transformer_options."""
        model_options = copy.copy(self.model_options)
        model_options["transformer_options"] = dict(self.model_options["transformer_options"])
        for callback in self._callbacks(CallbacksMP.ON_PREPARE_STATE):
            callback(self, torch.tensor([sigma]), model_options)
        options = model_options["transformer_options"]
        options["sigmas"] = torch.tensor([sigma])
        return self.diffusion_model(*inputs, transformer_options=options, **kwargs)

    def cleanup(self):
        for callback in self._callbacks(CallbacksMP.ON_CLEANUP):
            callback(self)
