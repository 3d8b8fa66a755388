import os

import uvicorn
from django.core.management.base import BaseCommand, CommandError, CommandParser

from executors.simllm import SimLLM


class Command(BaseCommand):
    help = (
        "Serve a simulated OpenAI-compatible model server (/v1/chat/completions, /v1/embeddings, /v1/models) on "
        "127.0.0.1, for demos, tests of the HTTP drivers and capacity planning. Replies are labelled simulated."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--latency-ms", type=float, default=50, help="time before the first token (default 50)")
        parser.add_argument("--tokens-per-s", type=float, default=0, help="generation speed; 0 = instant (default)")
        parser.add_argument("--fail-rate", type=float, default=0, help="share of requests answered 500 (0..1)")
        parser.add_argument("--output-tokens", type=int, default=16, help="completion tokens per reply (default 16)")
        parser.add_argument("--models", default="sim", help="comma-separated model names served (default: sim)")
        parser.add_argument(
            "--api-key",
            default=os.environ.get("SIMLLM_API_KEY"),
            help="answer 401 to requests without it (default: $SIMLLM_API_KEY; none: no key needed)",
        )
        parser.add_argument(
            "--api-key-header",
            default="Authorization",
            help="where the key is looked for: Authorization (as 'Bearer <key>', the default) or another header",
        )

    def handle(self, *args, **o) -> None:
        if not 0 <= o["fail_rate"] <= 1:
            raise CommandError("--fail-rate must be between 0 and 1")
        if o["latency_ms"] < 0 or o["tokens_per_s"] < 0 or o["output_tokens"] < 0:
            raise CommandError("--latency-ms, --tokens-per-s and --output-tokens must not be negative")
        models = [m.strip() for m in o["models"].split(",") if m.strip()]
        if not models:
            raise CommandError("--models needs at least one model name")
        app = SimLLM(
            models=models,
            latency_ms=o["latency_ms"],
            tokens_per_s=o["tokens_per_s"],
            fail_rate=o["fail_rate"],
            output_tokens=o["output_tokens"],
            api_key=o["api_key"],
            api_key_header=o["api_key_header"],
        )
        self.stdout.write(f"simllm serving {', '.join(models)} on http://{o['host']}:{o['port']}/v1 (simulated)")
        uvicorn.run(app, host=o["host"], port=o["port"], log_level="warning", backlog=4096, timeout_keep_alive=30)
