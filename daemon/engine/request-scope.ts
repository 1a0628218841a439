/**
 * What every service that runs generation checks and sets up per request, in one place: the
 * prompt is tokenized and admitted (not empty, inside the vocabulary, shorter than the context,
 * leaving room for max_tokens),
 * and one AbortSignal carries both the client's cancel and the deadline, each with its own reason.
 */
import { ShoalError } from '../errors.ts'
import type { GenerateRequest } from '../service.ts'
import type { TextCodec } from '../text/index.ts'
import type { ModelShape } from '../../shards/index.ts'
import { AbortedError, ContextLengthError, DeadlineError, RequestTooLongError } from './errors.ts'
import { MAX_TIMER_MS } from '../abort.ts'


/**
 * Token ids of the request's prompt, or a typed error (400 / 413) before any work starts. A
 * prompt whose length alone shows it cannot fit is refused before tokenizing; long prompts are
 * tokenized off the event loop (TextCodec.encodePromptAsync).
 */
export async function admitPrompt (codec: TextCodec, request: GenerateRequest, shape: ModelShape, signal?: AbortSignal): Promise<number[]> {
  const context = shape.maxPositions
  const atLeast = codec.minPromptTokens(request.prompt)
  if (atLeast >= context) {
    throw new ContextLengthError(`the prompt has at least ${atLeast} tokens; this model's context is ${context} tokens, including the completion`)
  }
  const promptIds = await codec.encodePromptAsync(request.prompt, signal)
  if (promptIds.length === 0) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', 'the prompt is empty')
  const bad = promptIds.find(id => !Number.isSafeInteger(id) || id < 0 || id >= shape.vocabSize)
  if (bad !== undefined) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', `token id ${bad} is outside the vocabulary (0..${shape.vocabSize - 1})`)
  if (promptIds.length >= context) {
    throw new ContextLengthError(`the prompt has ${promptIds.length} tokens; this model's context is ${context} tokens, including the completion`)
  }
  checkCompletionFits(promptIds.length, request.maxTokens, context)
  if (Date.now() >= request.deadline) throw new DeadlineError()
  return promptIds
}

/**
 * A max_tokens that cannot fit beside the prompt is a client error (400), as in vLLM and OpenAI,
 * rather than a silent cap: the message names both numbers and the context.
 */
export function checkCompletionFits (promptTokens: number, maxTokens: number | undefined, context: number): void {
  if (maxTokens === undefined || promptTokens + maxTokens <= context) return
  throw new RequestTooLongError(
    `This model's maximum context length is ${context} tokens. However, you requested ${promptTokens + maxTokens} tokens ` +
    `(${promptTokens} in the prompt, ${maxTokens} in the completion). Please reduce the length of the prompt or of max_tokens.`)
}

export interface RequestScope {
  /** Aborts on the client's cancel (AbortedError) or at the deadline (DeadlineError). */
  signal: AbortSignal
  /** Stops listening; call once the request is over. */
  dispose: () => void
}

export function requestScope (clientSignal: AbortSignal, deadline: number): RequestScope {
  const ctl = new AbortController()
  const onAbort = (): void => { ctl.abort(new AbortedError('client cancelled the request')) }
  clientSignal.addEventListener('abort', onAbort, { once: true })
  if (clientSignal.aborted) onAbort()
  const timer = setTimeout(() => { ctl.abort(new DeadlineError()) }, Math.min(Math.max(deadline - Date.now(), 0), MAX_TIMER_MS))
  return {
    signal: ctl.signal,
    dispose () {
      clearTimeout(timer)
      clientSignal.removeEventListener('abort', onAbort)
    },
  }
}
