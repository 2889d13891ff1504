// The official `openai` npm client against flashmesh's HTTP API: streams one greedy chat
// completion and prints {"text", "finish", "usage", "chunks"} as one JSON line.
// usage: node openai_stream.cjs BASE_URL MODEL PROMPT MAX_TOKENS [API_KEY]
'use strict';
const OpenAI = require('openai');

async function main() {
  const [baseURL, model, prompt, maxTokens, apiKey] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: apiKey || 'none', timeout: 60000, maxRetries: 0 });
  const stream = await client.chat.completions.create({
    model,
    messages: [{ role: 'user', content: prompt }],
    max_tokens: Number(maxTokens),
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
    ignore_eos: true,   // flashmesh (and vLLM) extension: the test wants exactly MAX_TOKENS tokens
  });
  let text = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    ++chunks;
    if (chunk.choices.length > 0) {
      text += chunk.choices[0].delta.content ?? '';
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  process.stdout.write(JSON.stringify({ text, finish, usage, chunks }) + '\n');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
