/**
 * A model's text codec: its tokenizer (@huggingface/tokenizers), its chat template and its BOS rule,
 * turning a PromptInput into token ids and generated ids back into text.
 *
 * BOS: text and chat prompts are encoded without the tokenizer's own special tokens, then get BOS
 * per the manifest's `addBosToken` unless they already start with it (a template that writes
 * `{{ bos_token }}` already added it). Token-id prompts are used as given.
 *
 * Long prompts: tokenizing costs about a microsecond per character on the calling thread, so
 * `encodePromptAsync` runs prompts longer than `offloadAboveChars` in a worker thread (the event
 * loop stays free), and `minPromptTokens` bounds a prompt's length from its characters alone (no
 * token of the vocabulary covers more characters than its longest entry), so a prompt that cannot
 * fit a context is refused before any tokenizing. The bound assumes the normalizer does not delete
 * characters (none of the Llama, Qwen, Phi or GPT-2 families' does) and the chat template renders
 * every message's content (the ones those families ship do; Llama-2's strips its ends).
 */
import { readFile } from 'node:fs/promises'
import { basename, join } from 'node:path'
import { Tokenizer } from '@huggingface/tokenizers'
import { ShoalError } from '../errors.ts'
import type { PromptInput } from '../service.ts'
import type { ShardManifest } from '../../shards/contract.ts'
import { chatTemplateSource, compileChatTemplate, specialTokenText } from './chat-template.ts'
import type { ChatTemplate } from './chat-template.ts'
import { createStreamingDetokenizer, memoizedDecoder } from './detok.ts'
import type { StreamingDetokenizer } from './detok.ts'
import { createTokenizerThread } from './tokenizer-thread.ts'
import type { TokenizerThread } from './tokenizer-thread.ts'
import type { TextCodecInit } from './codec-init.ts'

/** Prompts up to this many characters are tokenized inline (a few ms at most). */
export const DEFAULT_OFFLOAD_ABOVE_CHARS = 4096
/** Characters per token assumed when the vocabulary's form is not one we read. */
const FALLBACK_MAX_CHARS_PER_TOKEN = 64

export interface TextCodec {
  /** Prompt → token ids (chat rendered through the template; BOS per the rule above). */
  encodePrompt (prompt: PromptInput): number[]
  /** The same ids; long prompts are tokenized in a worker thread, off the event loop. */
  encodePromptAsync (prompt: PromptInput, signal?: AbortSignal): Promise<number[]>
  /** A lower bound on the prompt's token count from its length alone (no tokenizing). */
  minPromptTokens (prompt: PromptInput): number
  /** The most characters one token of this vocabulary covers. */
  readonly maxCharsPerToken: number
  /** Stops the tokenizer worker, if one was started. */
  close (): Promise<void>
  /** Plain text → ids, no special tokens added. */
  encode (text: string): number[]
  /** Ids → text, special tokens skipped. */
  decode (ids: number[]): string
  /** A fresh streaming detokenizer for one generation. */
  detokenizer (): StreamingDetokenizer
  readonly hasChatTemplate: boolean
}

export type { TextCodecInit }

/** The longest vocabulary entry or added token, in UTF-16 units (what `String.length` counts). */
export function longestTokenChars (tokenizerJson: object): number {
  const json = tokenizerJson as { model?: { vocab?: unknown }, added_tokens?: Array<{ content?: unknown }> }
  const vocab = json.model?.vocab
  let keys: string[]
  if (Array.isArray(vocab)) keys = vocab.map(v => Array.isArray(v) && typeof v[0] === 'string' ? v[0] : '') // Unigram: [piece, score]
  else if (typeof vocab === 'object' && vocab !== null) keys = Object.keys(vocab)
  else return FALLBACK_MAX_CHARS_PER_TOKEN
  let max = 1
  for (const k of keys) if (k.length > max) max = k.length
  for (const t of json.added_tokens ?? []) if (typeof t.content === 'string' && t.content.length > max) max = t.content.length
  return max
}

/**
 * Characters a prompt brings to the tokenizer: its text, or its messages' contents (chat
 * templates render each message's content and add their own markup; roles may be rendered as
 * other words, so they are not counted).
 */
function promptChars (prompt: PromptInput): number {
  switch (prompt.kind) {
    case 'tokens': return 0
    case 'text': return prompt.text.length
    case 'chat': {
      let n = 0
      for (const m of prompt.messages) n += m.content.length
      return n
    }
  }
}

export function createTextCodec (init: TextCodecInit): TextCodec {
  const tokenizer = new Tokenizer(init.tokenizerJson, init.tokenizerConfig)
  const source = chatTemplateSource(init.tokenizerConfig, init.chatTemplate)
  const template: ChatTemplate | undefined = source === undefined ? undefined : compileChatTemplate(source)
  const { bosTokenId, addBosToken } = init.generation
  const bosText = specialTokenText(init.tokenizerConfig.bos_token) ??
    (bosTokenId === undefined ? undefined : tokenizer.id_to_token(bosTokenId))
  const eosId = init.generation.eosTokenIds[0]
  const eosText = specialTokenText(init.tokenizerConfig.eos_token) ??
    (eosId === undefined ? undefined : tokenizer.id_to_token(eosId))

  const encode = (text: string): number[] => tokenizer.encode(text, { add_special_tokens: false }).ids
  const withBos = (ids: number[]): number[] =>
    addBosToken && bosTokenId !== undefined && ids[0] !== bosTokenId ? [bosTokenId, ...ids] : ids
  // tokenizers.js throws on an empty list; an empty window is common in streaming.
  const decode = (ids: number[]): string => ids.length === 0 ? '' : tokenizer.decode(ids, { skip_special_tokens: true })

  /** The streaming detokenizers' decoder: their small windows remembered across requests. */
  const windows = memoizedDecoder({ decode })
  const maxCharsPerToken = longestTokenChars(init.tokenizerJson)
  const offloadAbove = init.offloadAboveChars ?? DEFAULT_OFFLOAD_ABOVE_CHARS
  let thread: TokenizerThread | undefined

  const codec: TextCodec = {
    hasChatTemplate: template !== undefined,
    maxCharsPerToken,
    encode,
    decode,
    minPromptTokens (prompt) {
      return prompt.kind === 'tokens' ? prompt.ids.length : Math.ceil(promptChars(prompt) / maxCharsPerToken)
    },
    async encodePromptAsync (prompt, signal) {
      signal?.throwIfAborted()
      if (prompt.kind === 'tokens' || promptChars(prompt) <= offloadAbove) return codec.encodePrompt(prompt)
      thread ??= createTokenizerThread(init)
      return await thread.encodePrompt(prompt, signal)
    },
    async close () {
      const t = thread
      thread = undefined
      await t?.close()
    },
    encodePrompt (prompt) {
      switch (prompt.kind) {
        case 'tokens': return [...prompt.ids]
        case 'text': return withBos(encode(prompt.text))
        case 'chat': {
          if (template === undefined) {
            throw new ShoalError('SHOAL_ERR_BAD_REQUEST', 'this model has no chat template; use /v1/completions')
          }
          const text = template.render({
            messages: prompt.messages,
            addGenerationPrompt: true,
            ...(bosText === undefined ? {} : { bosToken: bosText }),
            ...(eosText === undefined ? {} : { eosToken: eosText }),
          })
          return withBos(encode(text))
        }
      }
    },
    detokenizer: () => createStreamingDetokenizer(windows),
  }
  return codec
}

/** Reads the tokenizer files a manifest lists from its shard directory. */
export async function loadTextCodec (shardDir: string, manifest: ShardManifest): Promise<TextCodec> {
  const byName = new Map(manifest.tokenizerFiles.map(f => [basename(f.path), f.path]))
  const read = async (name: string): Promise<string | undefined> => {
    const rel = byName.get(name)
    return rel === undefined ? undefined : await readFile(join(shardDir, rel), 'utf8')
  }
  const tokenizerJson = await read('tokenizer.json')
  if (tokenizerJson === undefined) {
    throw new ShoalError('SHOAL_ERR_SHARD_INVALID', `shard manifest lists no tokenizer.json (${shardDir})`)
  }
  const config = await read('tokenizer_config.json')
  const jinja = await read('chat_template.jinja')
  return createTextCodec({
    tokenizerJson: JSON.parse(tokenizerJson) as object,
    tokenizerConfig: config === undefined ? {} : JSON.parse(config) as Record<string, unknown>,
    ...(jinja === undefined ? {} : { chatTemplate: jinja }),
    generation: manifest.generation,
  })
}
