"""Chat templates of each tool-calling family, written here, each rendering tools, calls and
results in its family's documented format (the shapes of Qwen2.5's Hermes template, Llama 3.1's
JSON tool calling and Mistral v0.3's), and the tools the tests offer."""

from __future__ import annotations

# Qwen2.5 / Hermes: the tools in the system message, each call in <tool_call> tags, results in
# <tool_response> tags in a user turn. Like Qwen's, it refuses a system message anywhere but first.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}{% if not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama 3.1: the tools and the instruction in the last user message; a call is the whole reply,
# {"name": …, "parameters": …}; a result is an ipython turn.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% elif message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{% if tools and loop.last and message.role == 'user' %}"
    "Given the following functions, please respond with a JSON for a function call with its proper "
    'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}{% endif %}"
    "{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Mistral v0.3: [AVAILABLE_TOOLS] before the last user turn, calls after the special
# [TOOL_CALLS] token as a JSON list, results in [TOOL_RESULTS].
MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{% endfor %}]<|im_end|>"
    "{% elif message.role == 'assistant' %}{{ message.content }}<|im_end|>"
    "{% elif message.role == 'tool' %}"
    '[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{% elif message.role == 'system' %}{{ message.content }}\n\n{% endif %}"
    "{% endfor %}"
)

# gpt-oss's harmony, cut down: the tools in a developer message; each call a commentary-channel
# message naming its tool in the header, ended by <|call|>; a result a message from the tool;
# answers in the final channel, after their thinking in the analysis channel. The generation
# prompt opens an assistant message: the model picks the channel (analysis, final, commentary).
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json"
    "<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif message.role == 'tool' %}"
    "<|start|>functions.{{ message.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}"
    "{% if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{% endif %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

# The tokens each family's tokenizer adds: Qwen's tags are text, Mistral's [TOOL_CALLS] and
# harmony's markers are special.
ADDED = ("<tool_call>", "</tool_call>")
HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>")
SPECIAL = ("[TOOL_CALLS]", *HARMONY_SPECIAL)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_units",
        "description": "Convert a value from one unit to another.",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "to": {"enum": ["km", "mi", "kg", "lb"]},
            },
            "required": ["value", "to"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CONVERT]
