"""Request fields other OpenAI-compatible servers (OpenAI, vLLM, llama-server) accept that
Baton refuses by name, each with the reason: a field that would change the reply and that
Baton cannot honour is answered with a 400 saying why, never silently dropped.

Fields nobody has listed here are refused too, with a generic message."""

from __future__ import annotations

_BOTH: dict[str, str] = {
    # OpenAI
    "best_of": "best-of-n reranking is not served; send n and pick on the client",
    "prediction": "predicted outputs (speculative decoding from a given text) are not served",
    # vLLM
    "use_beam_search": "beam search is not served (llama.cpp samples one path per choice)",
    "length_penalty": "a beam-search setting; beam search is not served",
    "prompt_logprobs": "prompt log-probabilities are not computed (only the reply's)",
    "logprob_token_ids": "log-probabilities of chosen token ids are not served; use top_logprobs",
    "bad_words": "multi-token word bans are not served; ban single tokens with logit_bias -100",
    "guided_regex": "no regex-to-grammar converter for raw text; use guided_json with a pattern",
    "guided_grammar": "vLLM's grammars are xgrammar/Lark EBNF; send a llama.cpp GBNF grammar as grammar",
    "guided_decoding_backend": "Baton has one grammar engine (llama.cpp's)",
    "guided_whitespace_pattern": "Baton's JSON grammars fix the whitespace",
    "structured_outputs": "send response_format, guided_json or guided_choice",
    "return_tokens_as_token_ids": "log-probability tokens are always returned as text",
    "return_token_ids": "token ids are not returned; /tokenize gives them",
    "cache_salt": "the prefix cache is shared: per-tenant salting is not served",
    "kv_transfer_params": "disaggregated prefill is not served (replicas pull prefixes themselves)",
    "ec_transfer_params": "encoder-cache transfer is not served (text models only)",
    "vllm_xargs": "vLLM's custom extension arguments have no meaning here",
    "logits_processors": "custom logits processors are not served",
    "thinking_token_budget": "a reasoning budget is not enforced",
    "repetition_detection": "repetition detection is not served",
    "stream_interval": "every token is streamed as it comes",
    "watermarking": "watermarking is not served",
    "truncation_side": "prompts are never truncated: a prompt too long gets a 400",
    "truncate_prompt_tokens": "prompts are never truncated: a prompt too long gets a 400",
    "mm_processor_kwargs": "multimodal input is not served (text models only)",
    "media_io_kwargs": "multimodal input is not served (text models only)",
    # llama-server
    "n_predict": "send max_tokens",
    "n_probs": "send logprobs (completions) or top_logprobs (chat)",
    "repeat_penalty": "send repetition_penalty",
    "repeat_last_n": "the repetition penalty covers the whole prompt and reply (as vLLM's)",
    "penalty_last_n": "the repetition penalty covers the whole prompt and reply (as vLLM's)",
    "tfs_z": "tail-free sampling was removed from llama.cpp",
    "dynatemp_range": "dynamic temperature is not in Baton's sampler chain (yet)",
    "dynatemp_exponent": "dynamic temperature is not in Baton's sampler chain (yet)",
    "dry_multiplier": "DRY sampling is not in Baton's sampler chain (yet)",
    "dry_base": "DRY sampling is not in Baton's sampler chain (yet)",
    "dry_allowed_length": "DRY sampling is not in Baton's sampler chain (yet)",
    "dry_penalty_last_n": "DRY sampling is not in Baton's sampler chain (yet)",
    "dry_sequence_breakers": "DRY sampling is not in Baton's sampler chain (yet)",
    "samplers": "the sampler order is fixed (llama.cpp's default order)",
    "min_keep": "the sampler chain keeps at least one token",
    "id_slot": "Baton's router picks the replica and slot (by cached prefix)",
    "n_keep": "context shifting is not served: a reply ends at the context",
    "n_discard": "context shifting is not served: a reply ends at the context",
    "lora": "LoRA adapters are not served",
    "t_max_predict_ms": "no time limit per reply; send max_tokens",
    "post_sampling_probs": "log-probabilities are the model's, before sampling",
}

CHAT: dict[str, str] = {
    **_BOTH,
    "functions": "OpenAI's deprecated function calling: send tools",
    "function_call": "OpenAI's deprecated function calling: send tool_choice",
    "audio": "audio output is not served (text models only)",
    "web_search_options": "web search is not served",
    "verbosity": "OpenAI's GPT-5 setting; open models' templates do not read it",
    "echo": "chat echo is not served; use /v1/completions with echo",
    "chat_template": "the chat template is the server's (its chat_template setting)",
    "add_special_tokens": "the chat template places the special tokens",
    "return_prompt_text": "the rendered prompt is not returned",
}

COMPLETIONS: dict[str, str] = {
    **_BOTH,
    "suffix": "fill-in-the-middle is not served",
}
