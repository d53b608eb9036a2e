"""A LangGraph ReAct agent (`langgraph` + `langchain-openai`), unmodified, as asyncrl's `agent.path`.

`ChatOpenAI` is pointed at the episode's endpoint: the base URL and API key of the client asyncrl hands the
function (the key names the episode). A ReAct graph (a model node, LangGraph's prebuilt `ToolNode`, and
`tools_condition` between them: what `create_react_agent` builds, which LangGraph 1.x deprecates for `langchain`'s
`create_agent`) calls the model, runs the tools it asks for and sends the whole message list back on each turn;
the endpoint checks that list against what it sampled.

    asyncrl run --config tools_cpu.yaml tools.builtins=[] agent.path=examples/langgraph/agent.py

(tools_cpu.yaml's model was warm-started to call `calculator` on `add:1234+3678=`; docs/agents.md "Harnesses".)
"""
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from asyncrl.generator.agents.calculator import evaluate, format_number

MAX_TURNS = 3
"""Model turns per episode; the recipe's rollout.max_turns should be at least this."""


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. 1234+3678.
    """
    return format_number(evaluate(expression))  # asyncrl's bounded evaluator: no eval()


@tool
def digit_count(number: int) -> int:
    """Count the decimal digits of an integer.

    Args:
        number: the integer.
    """
    return len(str(abs(number)))


TOOLS = [calculator, digit_count]


def react_graph(model):
    """model -> tools -> model ... until a reply calls no tool."""
    model = model.bind_tools(TOOLS)

    async def call_model(state: MessagesState):
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


async def episode(row, client):
    """One episode: the ReAct graph over the task's prompt; 1.0 when its last message is the right answer."""
    model = ChatOpenAI(model="asyncrl", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    graph = react_graph(model)
    try:  # each model turn and each tool turn is one graph step
        state = await graph.ainvoke({"messages": list(row["prompt"])}, {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:  # the model kept calling tools: no answer
        return 0.0
    return float(str(state["messages"][-1].content).strip() == row["ground_truth"])
