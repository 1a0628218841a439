import { describe, expect, it } from 'vitest'
import { compileChatTemplate, createTextCodec } from '../../daemon/text/index.ts'
import { CHATML_TEMPLATE, LLAMA2_CHAT_TEMPLATE, llamaLikeTokenizer } from './fixtures.ts'

const generation = { bosTokenId: 1, eosTokenIds: [2], addBosToken: true }

describe('chat templates', () => {
  it("renders Llama-2's template with system prompt, bos/eos and alternation", () => {
    const t = compileChatTemplate(LLAMA2_CHAT_TEMPLATE)
    const text = t.render({
      messages: [
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: 'hi ' },
        { role: 'assistant', content: 'hello' },
        { role: 'user', content: 'and you?' },
      ],
      addGenerationPrompt: true,
      bosToken: '<s>',
      eosToken: '</s>',
    })
    expect(text).toBe('<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST] hello </s><s>[INST] and you? [/INST]')
  })

  it('raise_exception becomes SHOAL_ERR_BAD_REQUEST', () => {
    const t = compileChatTemplate(LLAMA2_CHAT_TEMPLATE)
    let err: unknown
    try {
      t.render({ messages: [{ role: 'assistant', content: 'x' }], addGenerationPrompt: true, bosToken: '<s>', eosToken: '</s>' })
    } catch (e) { err = e }
    expect(err).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', name: 'ChatTemplateError' })
    expect((err as Error).message).toMatch(/roles must alternate/)
  })

  it('renders ChatML with add_generation_prompt', () => {
    const t = compileChatTemplate(CHATML_TEMPLATE)
    expect(t.render({ messages: [{ role: 'user', content: 'hi' }], addGenerationPrompt: true }))
      .toBe('<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n')
    expect(t.render({ messages: [{ role: 'user', content: 'hi' }], addGenerationPrompt: false }))
      .toBe('<|im_start|>user\nhi<|im_end|>\n')
  })
})

describe('prompt encoding and BOS', () => {
  const codec = createTextCodec({ ...llamaLikeTokenizer(), generation })

  it('text prompts get one BOS', () => {
    const ids = codec.encodePrompt({ kind: 'text', text: 'hello world' })
    expect(ids[0]).toBe(1)
    expect(ids.filter(i => i === 1)).toHaveLength(1)
    expect(codec.decode(ids)).toBe('hello world')
  })

  it('chat prompts whose template writes bos_token do not get a second BOS', () => {
    const ids = codec.encodePrompt({ kind: 'chat', messages: [{ role: 'user', content: 'hello' }] })
    expect(ids[0]).toBe(1)
    expect(ids[1]).not.toBe(1)
  })

  it('chat prompts whose template has no BOS get one when the model wants it', () => {
    const chatml = createTextCodec({ ...llamaLikeTokenizer(CHATML_TEMPLATE), generation })
    const ids = chatml.encodePrompt({ kind: 'chat', messages: [{ role: 'user', content: 'hello' }] })
    expect(ids[0]).toBe(1)
    const noBos = createTextCodec({ ...llamaLikeTokenizer(CHATML_TEMPLATE), generation: { ...generation, addBosToken: false } })
    expect(noBos.encodePrompt({ kind: 'chat', messages: [{ role: 'user', content: 'hello' }] })[0]).not.toBe(1)
  })

  it('token prompts are used as given', () => {
    expect(codec.encodePrompt({ kind: 'tokens', ids: [5, 6, 7] })).toEqual([5, 6, 7])
  })

  it('a model without a template rejects chat with a clear error', () => {
    const files = llamaLikeTokenizer()
    delete files.tokenizerConfig.chat_template
    const plain = createTextCodec({ ...files, generation })
    expect(plain.hasChatTemplate).toBe(false)
    expect(() => plain.encodePrompt({ kind: 'chat', messages: [{ role: 'user', content: 'x' }] }))
      .toThrow(expect.objectContaining({ code: 'SHOAL_ERR_BAD_REQUEST' }))
  })
})
