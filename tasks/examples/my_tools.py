"""tasks/examples/my_tools.py — tools as a researcher writes them (TRL's `tools=` convention).

Use with `--tools tasks/examples/my_tools.py:add,multiply` (a file path) or `--tools
tasks.examples.my_tools:add,multiply`.

A tool is a plain function with a type hint on every argument and a Google-style docstring: the
model sees its name, description and arguments as a JSON schema (tasks/tools.tool_schemas), calls it
by writing `<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>`, and reads
`str(result)` back as a tool message. A tool that raises gives the model the error text instead
(counted in the metrics).
"""


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum a + b.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The product a * b.
    """
    return a * b
