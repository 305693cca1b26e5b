"""The rollout role's generation engines: transformers (:mod:`.hf_worker`, sampling in :mod:`.sampling`) and vLLM
(:mod:`.vllm_worker`); each samples a step's responses and takes the actor's new weights."""
