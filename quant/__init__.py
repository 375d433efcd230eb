"""LowBit's quantization core: formats, policies, checkpoint IO and conversion. Never imports ComfyUI."""
