/**
 * JSON schemas for the request bodies. They check the types of the fields we know; unknown fields
 * are left alone (OpenAI clients send extras). Semantic checks that need a better message or a
 * decision (n ≠ 1, unsupported content parts, batched prompts) live in params.ts.
 */

const nullable = (schema: Record<string, unknown>): Record<string, unknown> => ({ anyOf: [schema, { type: 'null' }] })

const common = {
  model: { type: 'string', minLength: 1 },
  stream: nullable({ type: 'boolean' }),
  stream_options: nullable({
    type: 'object',
    properties: { include_usage: nullable({ type: 'boolean' }) },
  }),
  max_tokens: nullable({ type: 'integer', minimum: 1 }),
  temperature: nullable({ type: 'number', minimum: 0, maximum: 2 }),
  top_p: nullable({ type: 'number', exclusiveMinimum: 0, maximum: 1 }),
  seed: nullable({ type: 'integer' }),
  stop: nullable({
    anyOf: [
      { type: 'string' },
      { type: 'array', maxItems: 4, items: { type: 'string' } },
    ],
  }),
  n: nullable({ type: 'integer' }),
  presence_penalty: nullable({ type: 'number', minimum: -2, maximum: 2 }),
  frequency_penalty: nullable({ type: 'number', minimum: -2, maximum: 2 }),
  user: nullable({ type: 'string' }),
} as const

const contentPart = {
  type: 'object',
  required: ['type'],
  properties: { type: { type: 'string' }, text: { type: 'string' } },
}

export const chatBodySchema = {
  type: 'object',
  required: ['model', 'messages'],
  properties: {
    ...common,
    max_completion_tokens: nullable({ type: 'integer', minimum: 1 }),
    messages: {
      type: 'array',
      minItems: 1,
      // OpenAI's own bound; a body of hundreds of thousands of tiny messages is no conversation.
      maxItems: 2048,
      items: {
        type: 'object',
        required: ['role', 'content'],
        properties: {
          role: { type: 'string', minLength: 1 },
          content: { anyOf: [{ type: 'string' }, { type: 'array', items: contentPart }] },
          name: { type: 'string' },
        },
      },
    },
    logprobs: nullable({ type: 'boolean' }),
    tools: nullable({ type: 'array' }),
    response_format: nullable({ type: 'object', properties: { type: { type: 'string' } } }),
  },
} as const

export const completionBodySchema = {
  type: 'object',
  required: ['model', 'prompt'],
  properties: {
    ...common,
    // Shape only; params.ts tells a batch of prompts (unsupported) from bad input.
    prompt: { anyOf: [{ type: 'string' }, { type: 'array' }] },
    return_token_ids: nullable({ type: 'boolean' }),
    echo: nullable({ type: 'boolean' }),
    logprobs: nullable({ type: 'integer', minimum: 0 }),
    best_of: nullable({ type: 'integer' }),
    suffix: nullable({ type: 'string' }),
  },
} as const

/** What the schemas guarantee, as TypeScript sees it. */
interface CommonBody {
  model: string
  stream?: boolean | null
  stream_options?: { include_usage?: boolean | null } | null
  max_tokens?: number | null
  temperature?: number | null
  top_p?: number | null
  seed?: number | null
  stop?: string | string[] | null
  n?: number | null
  presence_penalty?: number | null
  frequency_penalty?: number | null
}

export interface ChatBody extends CommonBody {
  messages: Array<{ role: string, content: string | Array<{ type: string, text?: string }>, name?: string }>
  max_completion_tokens?: number | null
  logprobs?: boolean | null
  tools?: unknown[] | null
  response_format?: { type?: string } | null
}

export interface CompletionBody extends CommonBody {
  prompt: string | unknown[]
  return_token_ids?: boolean | null
  echo?: boolean | null
  logprobs?: number | null
  best_of?: number | null
  suffix?: string | null
}
