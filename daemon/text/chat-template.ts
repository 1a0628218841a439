/**
 * Chat templates: tokenizer_config.json's `chat_template` (Jinja) rendered with @huggingface/jinja,
 * the way transformers' apply_chat_template does it. A template's raise_exception becomes a
 * SHOAL_ERR_BAD_REQUEST (it rejects the conversation, e.g. roles that do not alternate).
 */
import { Template } from '@huggingface/jinja'
import { ShoalError } from '../errors.ts'
import type { ChatMessage } from '../service.ts'

export interface ChatTemplateInput {
  messages: ChatMessage[]
  addGenerationPrompt: boolean
  bosToken?: string
  eosToken?: string
}

export class ChatTemplateError extends ShoalError {
  override name = 'ChatTemplateError'
  constructor (message: string, options?: ErrorOptions) {
    super('SHOAL_ERR_BAD_REQUEST', message, options)
  }
}

export interface ChatTemplate {
  render (input: ChatTemplateInput): string
}

export function compileChatTemplate (source: string): ChatTemplate {
  const template = new Template(source)
  return {
    render (input) {
      try {
        return template.render({
          messages: input.messages.map(m => ({ ...m })),
          add_generation_prompt: input.addGenerationPrompt,
          bos_token: input.bosToken ?? '',
          eos_token: input.eosToken ?? '',
        })
      } catch (err) {
        throw new ChatTemplateError(`chat template rejected the conversation: ${(err as Error).message}`, { cause: err })
      }
    },
  }
}

/**
 * The template text from a tokenizer_config.json: a string, or a list of named templates (the
 * 'default' one is used), or absent. `chat_template.jinja` beside the config wins when present.
 */
export function chatTemplateSource (tokenizerConfig: Record<string, unknown>, jinjaFile?: string): string | undefined {
  if (jinjaFile !== undefined) return jinjaFile
  const t = tokenizerConfig.chat_template
  if (typeof t === 'string') return t
  if (Array.isArray(t)) {
    const named = t as Array<{ name?: unknown, template?: unknown }>
    const found = named.find(x => x.name === 'default') ?? named[0]
    if (typeof found?.template === 'string') return found.template
  }
  return undefined
}

/** A special token in tokenizer_config.json is a string or an AddedToken object. */
export function specialTokenText (value: unknown): string | undefined {
  if (typeof value === 'string') return value
  if (value !== null && typeof value === 'object' && typeof (value as { content?: unknown }).content === 'string') {
    return (value as { content: string }).content
  }
  return undefined
}
