"""Each command's examples and notes, shown at the end of its --help."""

GENERATE_EPILOG = """\
[bold]Examples[/]

  llmcli generate "Name the capital of France."

  cat notes.txt | llmcli generate "Summarize in three bullet points:"

  llmcli generate -m Qwen/Qwen2.5-0.5B-Instruct -t 0 --json "2+2=" | jq .text   [dim]# needs the Hub once[/]

  llmcli generate -m ./model.gguf --stop "\\n\\n" --max-new-tokens 64 "Once upon a time"

  llmcli generate --batch questions.txt --batch-size 16 --json > answers.jsonl

With both arguments and stdin, the prompt is the arguments, a blank line, then stdin.
Exit codes: 0 done, 1 failure, 2 usage error, 130 interrupted.
"""

CHAT_EPILOG = """\
[bold]Examples[/]

  llmcli chat

  llmcli chat -m Qwen/Qwen2.5-0.5B-Instruct -s "Answer in one sentence." --markdown \
  [dim]# needs the Hub once[/]

  printf 'Hi!\\nWhat did I just say?\\n' | llmcli chat --json -t 0

On a terminal: Esc then Enter (or a block between \"\"\" lines) for multiline input, Tab completes \
slash commands, Ctrl-C stops a reply and keeps the conversation, Ctrl-D leaves. /help lists the commands.

With stdin not a terminal, each line is one user message (or slash command) and each reply is \
printed in turn; --json prints one object per turn instead.
"""

BENCH_EPILOG = """\
[bold]Examples[/]

  llmcli bench

  llmcli bench --config configs/llama-3.1-8b.json --random-weights --device cuda --json

  llmcli bench -m Qwen/Qwen2.5-0.5B-Instruct --prompt-lengths 128,1024 --new-tokens 256 --runs 7 \
  [dim]# needs the Hub once[/]

  llmcli bench --speculative lookup -n 200 --runs 3

  llmcli bench --concurrency 1,2,4,8 --prompt-lengths 256 [dim]# sequences decoded together[/]

  llmcli bench --config configs/llama-3.2-1b.json --random-weights --device cuda --draft-model self

  llmcli bench --config configs/llama-3.2-1b.json --random-weights --context-fill 8192

Decode at batch 1 reads every weight once per token: "% of measured bandwidth" says how close \
decoding comes to that floor, with the bandwidth measured on the spot by a large device copy; \
the ceiling line times the model's linear layers alone, the fastest any batch-1 decode of these \
weights can go on this device.
"""

SERVE_EPILOG = """\
[bold]Examples[/]

  llmcli serve                       # the default model at http://127.0.0.1:8471/v1

  llmcli serve -m Qwen/Qwen2.5-0.5B-Instruct --port 9000   [dim]# needs the Hub once[/]

  curl -s localhost:8471/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hi"}]}'

While it runs, [bold]llmcli generate[/] with the same model and settings uses it by itself (no load,
no torch import); --no-server loads in-process instead. Any OpenAI client works against it.
"""
