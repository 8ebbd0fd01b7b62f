"""The model engine. Only the torch-backed modules (model, loader, kv_cache, runner, sampler)
import torch; sequence, block_manager, scheduler and sim stay pure so sim nodes never load it."""
