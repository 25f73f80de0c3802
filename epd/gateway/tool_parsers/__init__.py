"""vLLM's tool call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`): the calls a
model writes in its answer, each in `<tool_call>` tags, in its family's form:

    hermes       (Qwen2.5, Qwen3, Qwen3-VL; Hermes' own) a JSON object per call
                 <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>
    qwen3_coder  (Qwen3-Coder, Qwen3.5) a function tag, a tag per parameter, the values as text
                 <tool_call>
                 <function=get_weather>
                 <parameter=city>
                 Paris
                 </parameter>
                 </function>
                 </tool_call>

become the message's `tool_calls` ({"id": "chatcmpl-tool-<hex>", "type": "function", "function":
{"name", "arguments": JSON text}}); the text outside the calls stays the content. No HTTP and no
tokenizer in here: the chat door (`epd.gateway.http_api`) feeds each choice's decoded content
(after the reasoning parser's split, when one is set), whole or as the stream's deltas; `epd ask
--tools` feeds the SDK's answer the same way.

The rules, the same whole and streamed (`stream.parse_tool_calls` is the stream fed one delta):
- a block that is not a call (hermes: JSON that does not parse, or is not {"name": string,
  "arguments": object}; qwen3_coder: no `<function=NAME>` or no `</function>`) is left in the
  content as the model wrote it, tags included (vLLM's hermes leaves the whole answer as content
  when any call is malformed; epd decides call by call);
- a call cut before `</tool_call>` (max_tokens, a stop) is a call if it is whole (hermes: its JSON;
  qwen3_coder: its `</function>`), else content;
- text outside the calls that is whitespace alone (the newlines around and between calls) is
  dropped once a call is made; the content is null when nothing else is left. An answer without
  any call is its text whole, as vLLM's.

The arguments' text: hermes', the arguments object as `json.dumps(arguments, ensure_ascii=False)`
writes it (`, ` and `: ` between items, strings with their escapes decoded), built value by value
as the model writes them (`json_text.JsonNormalizer`; an object that repeats a key keeps both, where
`json.loads` would keep the last); qwen3_coder's, `{"PARAM": value, ...}` in the same form, each
value converted by the type of its parameter in the request's tool's schema, as vLLM's
(`qwen3_coder.parameter_value`).

Streamed, a tag's start split across deltas (`<tool`, `_call>`) is held back until the next delta
shows what it is, and a call goes out as vLLM's do, in its delta shape: one chunk with its index,
id, type and name (arguments ""), once the name is read, then its arguments' text in fragments as
the model writes them: hermes' once `{"name": "...", "arguments": {` is read (the order the
templates teach; a call written otherwise goes out whole at its `</tool_call>`), a value's text as
it grows (a string's characters, a number or literal when it ends); qwen3_coder's `{` with the
name, a parameter when its `</parameter>` is followed by the next tag, `}` at `</function>`. The
fragments of a call join to exactly the whole answer's arguments. A call that goes wrong after its
name went out (max_tokens cuts it, its JSON breaks) cannot be taken back: what was sent stays, the
rest of its block is dropped and the finish reason is "tool_calls", as vLLM's stream (whose whole
answer, as epd's, keeps such a block as content).

The files, one concept each:

    calls.py        what a parser gives (a whole call, a streamed call's header and fragments) and
                    the contract of a reader of one `<tool_call>` block's body
    markers.py      the `<tool_call>` tags and the one search for a marker (the tests count it)
    json_text.py    JSON text read as it grows: strings and their escapes, a call's start, a
                    value rewritten as `json.dumps` writes it
    hermes.py       hermes' reader (a JSON object per block)
    qwen3_coder.py  qwen3_coder's reader (function and parameter tags) and its values' types
    required.py     tool_choice "required"'s answer, the grammar's JSON array of calls
    stream.py       an answer's text parted into content and calls by a parser, whole or by delta
    answer.py       an answer under the request's tool choice: its calls, finish reason and deltas
"""
