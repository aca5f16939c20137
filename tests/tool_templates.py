"""Chat templates in the style of Qwen3's (its tool format: the tools as JSON lines in a "# Tools"
system block, calls in <tool_call> tags, results as <tool_response> user turns; no reasoning
parts) and of Llama 3.1's (JSON calls, `ipython` results), written for the tests of tool calling
on tiny random-weight models."""

QWEN3_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in message.tool_calls or [] %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set fn = call.function if call.function else call %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# In the style of Llama 3.1's template (its tool conventions on the tiny tokenizer's special
# tokens): the tools as JSON in the last user turn with the answer format, a call written as
# {"name": ..., "parameters": {...}} for the assistant turn, results as `ipython` turns.
LLAMA3_STYLE_TEMPLATE = """\
{%- set last_user = namespace(i=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}\
{%- set last_user.i = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' and tools and loop.index0 == last_user.i %}
{{- '<|im_start|>user\\nAnswer with a JSON function call when a function helps. Respond in ' }}
{{- 'the format {"name": function name, "parameters": dictionary of arguments}.\\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}
{{- '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
{%- for call in message.tool_calls %}
{%- if not loop.first %}{{- '; ' }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "parameters": ' }}
{{- (call.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|im_start|>ipython\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
