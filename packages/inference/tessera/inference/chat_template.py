"""Chat templates are rendered by `tessera.common.chat_template` (shared with `tessera-data prep`'s
chat fine-tuning data); the server's names for it."""

from tessera.common.chat_template import ChatTemplateError, render_chat

__all__ = ["ChatTemplateError", "render_chat"]
