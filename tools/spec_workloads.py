"""The two workloads of tools/bench_spec.py: 32 input-grounded prompts (repeat with edits,
extract, continue code or text given in the prompt) and 32 open-chat prompts."""

from __future__ import annotations

SOURCES: list[tuple[str, str, str]] = [  # (kind, text, an edit to make while repeating it)
    ("Python code", '''def total_price(items):
    total = 0
    for item in items:
        if item.count > 0:
            total += item.price * item.count
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
''', "rename the variable `total` to `subtotal`"),
    ("Python code", '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
''', "rename the class `Stack` to `LifoStack`"),
    ("JavaScript code", '''function formatUser(user) {
  const name = user.firstName + " " + user.lastName;
  const email = user.email.toLowerCase();
  return { name: name, email: email, active: user.active };
}

function activeUsers(users) {
  return users.filter((user) => user.active).map(formatUser);
}
''', "use `const` arrow functions instead of `function` declarations"),
    ("SQL query", '''SELECT customers.id, customers.name, SUM(orders.amount) AS total
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.id, customers.name
HAVING SUM(orders.amount) > 1000
ORDER BY total DESC
LIMIT 10;
''', "change the date to '2025-01-01'"),
    ("JSON configuration", '''{
  "server": {"host": "0.0.0.0", "port": 8080, "workers": 4},
  "database": {"url": "postgres://db:5432/app", "pool_size": 10},
  "logging": {"level": "info", "format": "json"},
  "features": {"signup": true, "billing": false, "search": true}
}
''', "set the port to 9090"),
    ("paragraph", '''The city library opens at nine in the morning and closes at six in the
evening on weekdays. On Saturdays it opens at ten and closes at four. It is closed on Sundays
and on public holidays. Members may borrow up to ten books at a time for three weeks, and
they may renew each book twice online or at the front desk.
''', "replace `ten books` with `twelve books`"),
    ("shopping list", '''- 2 liters of milk
- 1 loaf of whole wheat bread
- 6 eggs
- 500 grams of pasta
- 1 jar of tomato sauce
- 3 apples
- 1 bag of coffee beans
- 200 grams of cheddar cheese
''', "change `6 eggs` to `12 eggs`"),
    ("email", '''Hi Sam,

Thanks for sending the report on Friday. I read it over the weekend and I think the numbers
for the second quarter look good. Could you add a short section on the marketing costs and
send me the updated version by Wednesday? After that we can schedule the review meeting.

Best regards,
Alex
''', "change `Wednesday` to `Thursday`"),
]

TASKS = (
    "Repeat the {kind} below exactly, but {edit}. Output only the result.\n\n{text}",
    "Copy the {kind} below word for word, without any change.\n\n{text}",
    "Here is a {kind}:\n\n{text}\nRewrite the whole {kind}, adding a short comment or note "
    "after its first line, and keep everything else the same.",
    "Continue the following {kind}, repeating it first and then adding more in the same "
    "style.\n\n{text}",
)

GROUNDED: list[str] = [task.format(kind=kind, text=text, edit=edit)
                       for task in TASKS for kind, text, edit in SOURCES]

CHAT: list[str] = [
    "What are three good habits for staying healthy?",
    "Tell me a short story about a cat who learns to swim.",
    "Why is the sky blue?",
    "Give me some ideas for a birthday party for a ten year old.",
    "What is the difference between weather and climate?",
    "How do I make a cup of green tea?",
    "Write a short poem about the ocean.",
    "What should I pack for a weekend camping trip?",
    "Explain what a computer program is to a child.",
    "What are the benefits of reading books?",
    "How can I improve my sleep?",
    "Describe a beautiful sunset.",
    "What is photosynthesis?",
    "Suggest a name for a new coffee shop and explain why.",
    "What are some fun things to do on a rainy day?",
    "How do airplanes stay in the air?",
    "Write a thank you note to a teacher.",
    "What is the best way to learn a new language?",
    "Tell me about the planets in our solar system.",
    "How do I start a small vegetable garden?",
    "What makes a good friend?",
    "Explain why exercise is important.",
    "Write a short motivational message for a student before an exam.",
    "What are some tips for saving money?",
    "How does a rainbow form?",
    "Describe your ideal vacation.",
    "What is the history of the bicycle?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change color in autumn?",
    "What are the main causes of stress and how can I reduce it?",
    "Write a short dialogue between a robot and a dog.",
    "How do bees make honey?",
]

WORKLOADS = {"grounded": GROUNDED, "chat": CHAT}
assert len(GROUNDED) == 32 and len(CHAT) == 32
