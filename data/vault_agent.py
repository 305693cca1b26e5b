"""The vault task's agent as a plain OpenAI-SDK program: the ``openai_agent`` loop's example (docs/gateway.md).

It knows nothing of ppoflow's agent loops: it asks the model (the gateway, through ``client``) with the ``vault`` tool
offered, runs the tool itself when the model calls it, sends the answer back as a ``tool`` message, and returns the
model's last text as its final answer. Trained with ``benchmarks/tool_use.py --variants "openai agent"``.
"""

from __future__ import annotations

from ppoflow.data.vault import vault

VAULT_TOOL = {
    "type": "function",
    "function": {
        "name": "vault",
        "description": "Open the vault of the question's key and read the code it holds.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


async def agent(client, row, *, model: str = "policy", max_turns: int = 2) -> str:
    """Answer one vault row: at most ``max_turns`` model turns, each tool call answered with the row's vault."""
    key = row["tools_kwargs"]["vault"]["key"]
    messages = list(row["prompt"])
    text = ""
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[VAULT_TOOL])
        message = reply.choices[0].message
        text = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": vault(key)} for call in message.tool_calls]
    return text
