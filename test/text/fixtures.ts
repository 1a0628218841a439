/**
 * A Llama-2-shaped tokenizer built in code (no download): SentencePiece-style BPE with byte
 * fallback, Prepend/Replace normalizer, the Replace/ByteFallback/Fuse/Strip decoder chain, and
 * Llama-2's own chat template. Characters outside the small vocabulary become <0xNN> byte tokens,
 * so multi-byte UTF-8 characters really are split across tokens.
 */

export const LLAMA2_CHAT_TEMPLATE = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"

export const CHATML_TEMPLATE = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

const WORDS = ['hello', 'world', 'the', 'stop', 'end', 'and', 'you', 'INST', 'SYS', 'café']
const CHARS = [...'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?[]<>/\'":-_()']

export interface TokenizerFiles {
  tokenizerJson: Record<string, unknown>
  tokenizerConfig: Record<string, unknown>
}

export function llamaLikeTokenizer (chatTemplate: string = LLAMA2_CHAT_TEMPLATE): TokenizerFiles {
  const vocab: Record<string, number> = {}
  const add = (t: string): void => { if (!(t in vocab)) vocab[t] = Object.keys(vocab).length }
  for (const t of ['<unk>', '<s>', '</s>']) add(t)
  for (let b = 0; b < 256; b++) add(`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`)
  add('▁')
  for (const c of CHARS) add(c)
  const merges: string[] = []
  for (const w of WORDS) {
    const pieces = [...`▁${w}`]
    let acc = pieces[0] as string
    for (const c of pieces.slice(1)) {
      if (!(c in vocab)) break
      const merged = acc + c
      if (!(merged in vocab)) { merges.push(`${acc} ${c}`); add(merged) }
      acc = merged
    }
  }
  const special = (id: number, content: string): Record<string, unknown> =>
    ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true })
  const tokenizerJson = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>')],
    normalizer: {
      type: 'Sequence',
      normalizers: [{ type: 'Prepend', prepend: '▁' }, { type: 'Replace', pattern: { String: ' ' }, content: '▁' }],
    },
    pre_tokenizer: null,
    post_processor: {
      type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
    },
    decoder: {
      type: 'Sequence',
      decoders: [
        { type: 'Replace', pattern: { String: '▁' }, content: ' ' },
        { type: 'ByteFallback' },
        { type: 'Fuse' },
        { type: 'Strip', content: ' ', start: 1, stop: 0 },
      ],
    },
    model: {
      type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab, merges,
    },
  }
  const tokenizerConfig = {
    add_bos_token: true,
    add_eos_token: false,
    bos_token: '<s>',
    eos_token: '</s>',
    unk_token: '<unk>',
    clean_up_tokenization_spaces: false,
    legacy: false,
    tokenizer_class: 'LlamaTokenizer',
    chat_template: chatTemplate,
  }
  return { tokenizerJson, tokenizerConfig }
}
