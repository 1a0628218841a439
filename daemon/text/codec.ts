/**
 * A model's text codec: its tokenizer (@huggingface/tokenizers), its chat template and its BOS rule,
 * turning a PromptInput into token ids and generated ids back into text.
 *
 * BOS: text and chat prompts are encoded without the tokenizer's own special tokens, then get BOS
 * per the manifest's `addBosToken` unless they already start with it (a template that writes
 * `{{ bos_token }}` already added it). Token-id prompts are used as given.
 */
import { readFile } from 'node:fs/promises'
import { basename, join } from 'node:path'
import { Tokenizer } from '@huggingface/tokenizers'
import { ShoalError } from '../errors.ts'
import type { PromptInput } from '../service.ts'
import type { GenerationDefaults, ShardManifest } from '../../shards/contract.ts'
import { chatTemplateSource, compileChatTemplate, specialTokenText } from './chat-template.ts'
import type { ChatTemplate } from './chat-template.ts'
import { createStreamingDetokenizer } from './detok.ts'
import type { StreamingDetokenizer } from './detok.ts'

export interface TextCodec {
  /** Prompt → token ids (chat rendered through the template; BOS per the rule above). */
  encodePrompt (prompt: PromptInput): number[]
  /** Plain text → ids, no special tokens added. */
  encode (text: string): number[]
  /** Ids → text, special tokens skipped. */
  decode (ids: number[]): string
  /** A fresh streaming detokenizer for one generation. */
  detokenizer (): StreamingDetokenizer
  readonly hasChatTemplate: boolean
}

export interface TextCodecInit {
  tokenizerJson: object
  tokenizerConfig: Record<string, unknown>
  /** Overrides tokenizer_config's chat_template (e.g. from chat_template.jinja). */
  chatTemplate?: string
  generation: GenerationDefaults
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

  return {
    hasChatTemplate: template !== undefined,
    encode,
    decode,
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
    detokenizer: () => createStreamingDetokenizer({ decode }),
  }
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
