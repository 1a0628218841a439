/**
 * Pure translation of validated OpenAI request bodies into the service's terms, with the checks a
 * JSON schema cannot express well (n ≠ 1, unsupported features, batched prompts, lone surrogates,
 * token ids no vocabulary holds).
 */
import type { ChatMessage, PromptInput, SamplingParams } from '../service.ts'
import { findLoneSurrogate } from '../text/index.ts'
import { badRequest, unsupported } from './errors.ts'
import type { ChatBody, CompletionBody } from './schemas.ts'

/** The parts of a GenerateRequest that come from the body (requestId and deadline come from the ingress). */
export interface ParsedRequest {
  model: string
  prompt: PromptInput
  maxTokens: number | undefined
  sampling: SamplingParams
  stop: string[]
  stream: boolean
  includeUsage: boolean
  returnTokenIds: boolean
}

/** OpenAI's legacy completions endpoint defaults to 16 tokens; chat runs to the context limit. */
export const COMPLETIONS_DEFAULT_MAX_TOKENS = 16

/** Bound of a token id any vocabulary (and /shoal/infer) can hold. */
const MAX_TOKEN_ID = 2 ** 32 - 1

function commonParams (body: ChatBody | CompletionBody): Omit<ParsedRequest, 'prompt' | 'maxTokens' | 'returnTokenIds'> {
  // Before anything is hashed or forwarded: text must be text (see daemon/text/well-formed.ts).
  const illFormed = findLoneSurrogate(body)
  if (illFormed !== undefined) {
    throw badRequest(`Invalid value for '${illFormed || 'request body'}': the string holds a lone UTF-16 surrogate (not valid Unicode text)`, illFormed || null)
  }
  if (body.n != null && body.n !== 1) throw unsupported('n', "Only 'n': 1 is supported")
  if (body.presence_penalty != null && body.presence_penalty !== 0) throw unsupported('presence_penalty')
  if (body.frequency_penalty != null && body.frequency_penalty !== 0) throw unsupported('frequency_penalty')
  const stop = body.stop == null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop
  if (stop.some(s => s === '')) throw badRequest('Stop sequences must not be empty', 'stop')
  const sampling: SamplingParams = { temperature: body.temperature ?? 1, topP: body.top_p ?? 1 }
  if (body.seed != null) sampling.seed = body.seed
  const stream = body.stream === true
  return { model: body.model, sampling, stop, stream, includeUsage: stream && body.stream_options?.include_usage === true }
}

export function parseChatBody (body: ChatBody): ParsedRequest {
  const common = commonParams(body)
  if (body.logprobs === true) throw unsupported('logprobs')
  if (body.tools != null && body.tools.length > 0) throw unsupported('tools')
  const format = body.response_format?.type
  if (format != null && format !== 'text') throw unsupported('response_format')
  const messages: ChatMessage[] = body.messages.map((m, i) => {
    const message: ChatMessage = { role: m.role, content: contentText(m.content, i) }
    if (m.name !== undefined) message.name = m.name
    return message
  })
  return {
    ...common,
    prompt: { kind: 'chat', messages },
    maxTokens: body.max_completion_tokens ?? body.max_tokens ?? undefined,
    returnTokenIds: false,
  }
}

function contentText (content: ChatBody['messages'][number]['content'], i: number): string {
  if (typeof content === 'string') return content
  return content.map((part, j) => {
    if (part.type !== 'text') throw unsupported(`messages[${i}].content[${j}].type`, `Content parts of type '${part.type}' are not supported; only 'text'`)
    if (typeof part.text !== 'string') throw badRequest("A 'text' content part needs a string 'text'", `messages[${i}].content[${j}].text`)
    return part.text
  }).join('')
}

export function parseCompletionBody (body: CompletionBody): ParsedRequest {
  const common = commonParams(body)
  if (body.echo === true) throw unsupported('echo')
  if (body.logprobs != null && body.logprobs !== 0) throw unsupported('logprobs')
  if (body.best_of != null && body.best_of !== 1) throw unsupported('best_of')
  if (body.suffix != null && body.suffix !== '') throw unsupported('suffix')
  return {
    ...common,
    prompt: promptInput(body.prompt),
    maxTokens: body.max_tokens ?? COMPLETIONS_DEFAULT_MAX_TOKENS,
    returnTokenIds: body.return_token_ids === true,
  }
}

function promptInput (prompt: CompletionBody['prompt']): PromptInput {
  if (typeof prompt === 'string') return { kind: 'text', text: prompt }
  if (prompt.length === 0) throw badRequest("'prompt' must not be an empty array", 'prompt')
  if (prompt.every(x => typeof x === 'number')) {
    const bad = prompt.findIndex(x => !Number.isSafeInteger(x) || (x as number) < 0)
    if (bad >= 0) throw badRequest('Token ids must be non-negative integers', `prompt[${bad}]`)
    // No vocabulary holds more: refused here, by any node, before the request goes anywhere.
    const huge = prompt.findIndex(x => (x as number) > MAX_TOKEN_ID)
    if (huge >= 0) throw badRequest(`Token id ${prompt[huge] as number} is outside any vocabulary (at most ${MAX_TOKEN_ID})`, `prompt[${huge}]`)
    return { kind: 'tokens', ids: prompt as number[] }
  }
  if (prompt.every(x => typeof x === 'string' || Array.isArray(x))) {
    throw unsupported('prompt', 'Batched prompts (an array of strings or of token arrays) are not supported; send one prompt per request')
  }
  throw badRequest("'prompt' must be a string or an array of token ids", 'prompt')
}
