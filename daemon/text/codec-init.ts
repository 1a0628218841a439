/** What a text codec is made from: kept apart so the tokenizer thread and its worker take it without importing the codec. */
import type { GenerationDefaults } from '../../shards/contract.ts'

export interface TextCodecInit {
  tokenizerJson: object
  tokenizerConfig: Record<string, unknown>
  /** Overrides tokenizer_config's chat_template (e.g. from chat_template.jinja). */
  chatTemplate?: string
  generation: GenerationDefaults
  /** Prompts longer than this (characters) are tokenized in a worker thread. Default DEFAULT_OFFLOAD_ABOVE_CHARS. */
  offloadAboveChars?: number
}
