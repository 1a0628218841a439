/**
 * Long prompts (issue 13 #2): a prompt's token count is bounded from its characters before any
 * tokenizing, and long prompts are tokenized in a worker thread, so the event loop stays free.
 */
import fc from 'fast-check'
import { afterAll, describe, expect, it } from 'vitest'
import { createTextCodec } from '../../daemon/text/index.ts'
import type { PromptInput } from '../../daemon/service.ts'
import { buildTokenizerJson } from '../../shards/testmodel/tokenizer.ts'
import { CHATML_TEMPLATE, llamaLikeTokenizer } from './fixtures.ts'

const generation = { bosTokenId: 1, eosTokenIds: [2], addBosToken: true }
const byteLevel = buildTokenizerJson(512, ['<s>', '</s>', '<|im_start|>', '<|im_end|>'], '<s>')
const codecs = {
  'SentencePiece-style BPE': createTextCodec({ ...llamaLikeTokenizer(CHATML_TEMPLATE), generation }),
  'byte-level BPE': createTextCodec({ tokenizerJson: byteLevel.tokenizerJson, tokenizerConfig: { chat_template: CHATML_TEMPLATE }, generation: { bosTokenId: 512 - 4, eosTokenIds: [512 - 3], addBosToken: true } }),
}

afterAll(async () => { for (const c of Object.values(codecs)) await c.close() })

describe.each(Object.entries(codecs))('%s', (_name, codec) => {
  it('minPromptTokens never exceeds the real token count (property)', () => {
    const text = fc.oneof(fc.string({ maxLength: 200 }), fc.string({ unit: 'grapheme', maxLength: 100 }), fc.constantFrom('<|im_start|><|im_end|>'.repeat(20), 'aaaa'.repeat(50)))
    const prompt: fc.Arbitrary<PromptInput> = fc.oneof(
      text.map(t => ({ kind: 'text' as const, text: t })),
      fc.array(fc.record({ role: fc.constantFrom('user', 'assistant', 'system'), content: text }), { minLength: 1, maxLength: 3 }).map(messages => ({ kind: 'chat' as const, messages })),
    )
    fc.assert(fc.property(prompt, p => codec.minPromptTokens(p) <= codec.encodePrompt(p).length), { numRuns: 200 })
  })

  it('an 8 MB prompt is bounded far past any context without tokenizing', () => {
    const text = 'x'.repeat(8 * 1024 * 1024)
    expect(codec.minPromptTokens({ kind: 'text', text })).toBeGreaterThan(100_000)
    expect(codec.minPromptTokens({ kind: 'chat', messages: [{ role: 'user', content: text }] })).toBeGreaterThan(100_000)
  })

  it('a long prompt is tokenized in a worker: same ids, and the event loop keeps running meanwhile', async () => {
    const text = 'The quick brown fox jumps over the lazy dog, café! '.repeat(2_000) // ~100 k characters
    let ticks = 0
    const timer = setInterval(() => { ticks++ }, 1)
    const ids = await codec.encodePromptAsync({ kind: 'text', text })
    clearInterval(timer)
    // Inline, the whole encode would run in one task and no tick could fire while it ran.
    expect(ticks).toBeGreaterThan(2)
    expect(ids).toEqual(codec.encodePrompt({ kind: 'text', text }))
  })

  it('short prompts and token prompts stay inline; errors keep their code across the worker', async () => {
    expect(await codec.encodePromptAsync({ kind: 'text', text: 'hello world' })).toEqual(codec.encodePrompt({ kind: 'text', text: 'hello world' }))
    expect(await codec.encodePromptAsync({ kind: 'tokens', ids: [3, 4] })).toEqual([3, 4])
    const aborted = AbortSignal.abort(new Error('gone'))
    await expect(codec.encodePromptAsync({ kind: 'text', text: 'x'.repeat(10_000) }, aborted)).rejects.toThrow('gone')
  })
})

describe('errors from the worker', () => {
  it('a chat prompt for a model without a template is SHOAL_ERR_BAD_REQUEST, however long', async () => {
    const files = llamaLikeTokenizer()
    delete files.tokenizerConfig.chat_template
    const plain = createTextCodec({ ...files, generation, offloadAboveChars: 0 })
    await expect(plain.encodePromptAsync({ kind: 'chat', messages: [{ role: 'user', content: 'x'.repeat(100) }] }))
      .rejects.toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST' })
    await plain.close()
  })
})
