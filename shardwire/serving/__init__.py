"""The HTTP side: the app (app.py) with its OpenAI routes (openai_api.py) and llama-server's
(llama_server_api.py), what they serve (state.py), chat templates (chat.py, chat_templates.py),
tool calls (tools.py), reasoning (reasoning.py), CORS (cors.py) and /metrics (metrics.py)."""
