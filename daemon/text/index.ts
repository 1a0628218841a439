/**
 * Text handling for a model: tokenizer, chat template, BOS rule, streaming detokenization that
 * never splits a UTF-8 character, and stop strings that never reach the client. Long prompts are
 * tokenized in a worker thread, and bounded from their length before that.
 */
export { createTextCodec, loadTextCodec } from './codec.ts'
export type { TextCodec, TextCodecInit } from './codec.ts'
export { compileChatTemplate } from './chat-template.ts'
export type { ChatTemplate, ChatTemplateInput } from './chat-template.ts'
export { createStopMatcher, heldSuffixLength } from './stop.ts'
export type { StopMatcher, StopPush } from './stop.ts'
export { findLoneSurrogate } from './well-formed.ts'
