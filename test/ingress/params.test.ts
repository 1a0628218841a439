/** The pure body → GenerateRequest translation. */
import { describe, expect, it } from 'vitest'
import { COMPLETIONS_DEFAULT_MAX_TOKENS, parseChatBody, parseCompletionBody } from '../../daemon/ingress/params.ts'

const messages = [{ role: 'user', content: 'hi' }]

describe('ingress params', () => {
  it('uses OpenAI defaults', () => {
    expect(parseChatBody({ model: 'm', messages })).toEqual({
      model: 'm',
      prompt: { kind: 'chat', messages },
      maxTokens: undefined,
      sampling: { temperature: 1, topP: 1 },
      stop: [],
      stream: false,
      includeUsage: false,
      returnTokenIds: false,
    })
    expect(parseCompletionBody({ model: 'm', prompt: 'x' }).maxTokens).toBe(COMPLETIONS_DEFAULT_MAX_TOKENS)
  })

  it('prefers max_completion_tokens and only honours include_usage when streaming', () => {
    expect(parseChatBody({ model: 'm', messages, max_tokens: 9, max_completion_tokens: 4 }).maxTokens).toBe(4)
    expect(parseChatBody({ model: 'm', messages, stream_options: { include_usage: true } }).includeUsage).toBe(false)
    expect(parseChatBody({ model: 'm', messages, stream: true, stream_options: { include_usage: true } }).includeUsage).toBe(true)
  })

  it('keeps temperature 0 (greedy) and the seed', () => {
    expect(parseChatBody({ model: 'm', messages, temperature: 0, seed: 0 }).sampling).toEqual({ temperature: 0, topP: 1, seed: 0 })
  })

  it('reads token-id prompts as given and a single stop string as a list', () => {
    const p = parseCompletionBody({ model: 'm', prompt: [0, 5, 7], stop: '\n', return_token_ids: true })
    expect(p.prompt).toEqual({ kind: 'tokens', ids: [0, 5, 7] })
    expect(p.stop).toEqual(['\n'])
    expect(p.returnTokenIds).toBe(true)
  })

  it('rejects empty stop strings', () => {
    expect(() => parseChatBody({ model: 'm', messages, stop: [''] })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_BAD_REQUEST', param: 'stop' }))
  })
})
