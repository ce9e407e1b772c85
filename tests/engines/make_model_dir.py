#!/usr/bin/env python3
"""A tiny Hugging Face model directory, and Python's own renderings of it, for parity tests.

The frontend tokenizes prompts and renders chat templates in Rust (the `tokenizers` crate and
minijinja); an engine such as vLLM does the same in Python (the `tokenizers` package and
transformers' jinja2 environment). This script builds a model directory the way the Hub ships
one and prints what Python makes of it, so a Rust test can demand the same bytes and ids.

  make_model_dir.py build DIR
      Trains a small byte-level BPE tokenizer in memory and writes DIR/tokenizer.json,
      DIR/tokenizer_config.json (with a ChatML-style chat template), DIR/config.json and
      DIR/templates/NAME.jinja (templates in the style of served models).

  make_model_dir.py reference DIR CASES_JSON
      Reads the cases (see `reference` below) and prints, as JSON on stdout, the jinja2
      rendering of each chat case, the `tokenizers` encodings of each text and the strftime
      output for a fixed time.

Needs the PyPI packages `tokenizers` and `jinja2` (PYTHONPATH may point at .tools/py).
"""

import json
import os
import sys
from datetime import datetime, timezone

# Special tokens of the model. `<s>` is added by the post-processor, so add_special_tokens
# changes the ids; the ChatML markers are what the chat template emits.
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# A chat template using what real templates use: a system-message split with slicing,
# `namespace`, loops with `loop.last` and `continue`, `message['role']`, `.strip()` (a Python
# string method), content given as a list of parts, tools through `tojson`, `raise_exception`
# for a bad role, indented block tags (lstrip_blocks), block tags ending lines (trim_blocks),
# expressions ending lines (no trimming), `bos_token`/`eos_token` and `add_generation_prompt`.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {% set system_message = messages[0]['content'] | trim %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system_message = 'You are a helpful assistant.' %}
    {% set loop_messages = messages %}
{% endif %}
<|im_start|>system
{{ system_message }}
{% if tools is not none %}
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
{% endif %}
<|im_end|>
{% set ns = namespace(turns=0) %}
{% for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('Unknown role: ' + message['role'] + '. Roles must be user, assistant or tool.') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% set ns.turns = ns.turns + 1 %}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['content'] is string %}
{{ message['content'].strip() }}
    {%- elif message['content'] is none %}
{{ message['content'] }}
    {%- else %}
        {% for part in message['content'] %}
            {% if part['type'] != 'text' %}
                {% continue %}
            {% endif %}
{{ part['text'].strip() }}{% if not loop.last %} {% endif %}
        {% endfor %}
    {% endif %}
    {% if message['tool_calls'] is defined %}
        {% for call in message['tool_calls'] %}

<tool_call>{{ call['function'] | tojson(indent=2) }}</tool_call>
        {%- endfor %}
    {% endif %}
<|im_end|>{% if message['role'] == 'assistant' and not loop.last %}{{ eos_token }}{% endif %}
{% if loop.last %}
{# turn {{ ns.turns }} #}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
turns={{ ns.turns }} gen={{ add_generation_prompt }} last={{ loop_messages | length }}"""

# Templates in the style of widely served models, written to DIR/templates/NAME.jinja; a
# chat case names one to be rendered with it (the frontend loads it as --chat-template).
EXTRA_TEMPLATES = {
    # Qwen2.5-style: tools as JSON lines, tool calls, grouped tool responses, `{{-`.
    "qwen2.5": """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
""",
    # Llama-3-style: a filter binding tighter than `+`, bos_token on the first message only.
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}"
              "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
              "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
              "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
              "{% endif %}",
    # Mistral-style: strict user/assistant alternation enforced with raise_exception.
    "mistral": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
               "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
               "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
               "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception("
               "'Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache keeps the attention keys and values of recent prompts.",
    "Routers send each request to the worker that already holds its prefix.",
    "Hello, world! Hello again, world.",
    "Tokenizers split text into tokens; tokens become ids.",
    "Unicode: café, naïve, 東京, Привет, emoji 🚀🎉.",
    "Numbers 0123456789 and symbols ~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    "    indented code\n\tand tabs\nand newlines\r\n",
]


def build(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", bos)],
    )
    # Many Hub tokenizer.json files carry a truncation setting; transformers turns it off for
    # every call that does not ask for truncation, and so must the frontend.
    tok.enable_truncation(max_length=16)
    tok.save(f"{out_dir}/tokenizer.json")

    config = {
        "bos_token": "<s>",
        # The AddedToken object form that older tokenizer_config.json files use.
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        # The sentinel transformers writes when a model sets no limit: must count as unset.
        "model_max_length": 1000000000000000019884624838656,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(f"{out_dir}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(f"{out_dir}/config.json", "w", encoding="utf-8") as f:
        json.dump({"model_type": "llama", "max_position_embeddings": 4096}, f, indent=2)
    os.makedirs(f"{out_dir}/templates", exist_ok=True)
    for name, source in EXTRA_TEMPLATES.items():
        with open(f"{out_dir}/templates/{name}.jinja", "w", encoding="utf-8") as f:
            f.write(source)


def special_token(value):
    """A special token as transformers' special_tokens_map gives it: the string content."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def compile_template(source):
    """transformers' `_compile_jinja_template`: the environment vLLM renders with."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def reference(model_dir, cases_path):
    """Cases: {"chats": [{"messages": [...], "add_generation_prompt": bool, "tools": [...]?,
    "template": NAME?}] (NAME from EXTRA_TEMPLATES, else the model's template),
    "texts": [str], "strftime": {"unix_seconds": int, "formats": [str]}}.
    Prints {"chats": [{"ok": str, "ids": [int]} | {"error": str}],
    "encodings": [{"text", "with_special", "without_special"}], "strftime": [str]}."""
    import jinja2
    from tokenizers import Tokenizer

    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    with open(f"{model_dir}/tokenizer_config.json", encoding="utf-8") as f:
        config = json.load(f)

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    # transformers' fast tokenizers call these for every encode without truncation/padding.
    tok.no_truncation()
    tok.no_padding()

    templates = {None: compile_template(config["chat_template"])}
    for name in EXTRA_TEMPLATES:
        with open(f"{model_dir}/templates/{name}.jinja", encoding="utf-8") as f:
            templates[name] = compile_template(f.read())
    special = {}
    for name in ("bos_token", "eos_token"):
        value = special_token(config.get(name))
        if value is not None:
            special[name] = value
    chats = []
    for case in cases.get("chats", []):
        try:
            # As transformers' render_jinja_template calls it: tools and documents are
            # always passed (None when absent), then the special tokens.
            text = templates[case.get("template")].render(messages=case["messages"], tools=case.get("tools"),
                                   documents=None,
                                   add_generation_prompt=case.get("add_generation_prompt", False),
                                   **special)
            # vLLM tokenizes a rendered chat without adding special tokens again.
            chats.append({"ok": text, "ids": tok.encode(text, add_special_tokens=False).ids})
        except jinja2.exceptions.TemplateError as e:
            chats.append({"error": str(e)})

    encodings = []
    for text in cases.get("texts", []):
        encodings.append({
            "text": text,
            "with_special": tok.encode(text, add_special_tokens=True).ids,
            "without_special": tok.encode(text, add_special_tokens=False).ids,
        })

    stamps = []
    st = cases.get("strftime")
    if st:
        # Naive UTC, as datetime.now() is on a server running in UTC.
        moment = datetime.fromtimestamp(st["unix_seconds"], tz=timezone.utc).replace(tzinfo=None)
        stamps = [moment.strftime(fmt) for fmt in st["formats"]]

    json.dump({"chats": chats, "encodings": encodings, "strftime": stamps}, sys.stdout,
              ensure_ascii=False)


def main(argv):
    if len(argv) == 3 and argv[1] == "build":
        build(argv[2])
    elif len(argv) == 4 and argv[1] == "reference":
        reference(argv[2], argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
