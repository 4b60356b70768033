// The official OpenAI Node client, unchanged, against the server: models, completions, chat
// (whole and streamed, with usage), reasoning, tool calls (whole and as stream deltas) and the
// errors it maps to its own exception classes. Run by openai_client_test.sh, which starts the
// server and passes: BASE_URL API_KEY OPENAI_MODULE_DIR.
import assert from "node:assert/strict";
import { createRequire } from "node:module";

const [baseURL, apiKey, moduleDir] = process.argv.slice(2);
const require = createRequire(import.meta.url);
const OpenAI = require(moduleDir);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30000 });

const tools = [{ type: "function", function: {
  name: "get_weather", description: "Current weather of a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];

const models = await client.models.list();
assert.equal(models.data[0].id, "scripted");

const completion = await client.completions.create({ model: "scripted", prompt: "Once upon a time", max_tokens: 8 });
assert.equal(completion.choices[0].finish_reason, "length");
assert.equal(completion.usage.completion_tokens, 8);
assert.ok(completion.choices[0].text.length > 0);

const chat = await client.chat.completions.create({
  model: "scripted", max_tokens: 64,
  messages: [{ role: "user", content: "What is the capital of France?" }] });
assert.equal(chat.choices[0].message.content.trim(), "The capital of France is Paris.");
assert.equal(chat.choices[0].message.reasoning_content.trim(), "Easy one.");

const stream = await client.chat.completions.create({
  model: "scripted", max_tokens: 64, stream: true, stream_options: { include_usage: true },
  messages: [{ role: "user", content: "What is the capital of France?" }] });
let content = "", chunks = 0, usage = null;
for await (const chunk of stream) {
  ++chunks;
  for (const c of chunk.choices) content += c.delta.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
assert.ok(chunks > 3);
assert.equal(content, chat.choices[0].message.content);
assert.equal(usage.completion_tokens, chat.usage.completion_tokens);

const called = await client.chat.completions.create({
  model: "scripted", max_tokens: 100, tools,
  messages: [{ role: "user", content: "What is the weather in Paris?" }] });
assert.equal(called.choices[0].finish_reason, "tool_calls");
const call = called.choices[0].message.tool_calls[0];
assert.equal(call.function.name, "get_weather");
assert.deepEqual(JSON.parse(call.function.arguments), { city: "Paris" });

// The tool result goes back in the next turn, as the client library builds it.
const followed = await client.chat.completions.create({
  model: "scripted", max_tokens: 8, tools,
  messages: [{ role: "user", content: "What is the weather in Paris?" }, called.choices[0].message,
             { role: "tool", tool_call_id: call.id, content: "sunny" }] });
assert.ok(followed.choices[0].message);

const toolStream = await client.chat.completions.create({
  model: "scripted", max_tokens: 100, tools, stream: true,
  messages: [{ role: "user", content: "What is the weather in Paris?" }] });
const streamedCalls = [];
for await (const chunk of toolStream) {
  for (const c of chunk.choices) for (const t of c.delta.tool_calls ?? []) streamedCalls.push(t);
}
assert.equal(streamedCalls.length, 1);
assert.equal(streamedCalls[0].function.name, "get_weather");

await assert.rejects(
  client.chat.completions.create({ model: "scripted", messages: [], max_tokens: 4 }),
  (e) => e instanceof OpenAI.BadRequestError && /messages/.test(e.message));
await assert.rejects(
  client.completions.create({ model: "no-such-model", prompt: "x" }),
  (e) => e instanceof OpenAI.BadRequestError && /model/.test(e.message));
const wrongKey = new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 });
await assert.rejects(wrongKey.models.list(), (e) => e instanceof OpenAI.AuthenticationError);

console.log("PASS: the official OpenAI client works unchanged");
