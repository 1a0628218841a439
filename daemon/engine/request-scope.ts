/**
 * What every service that runs generation checks and sets up per request, in one place: the
 * prompt is tokenized and admitted (not empty, inside the vocabulary, shorter than the context),
 * and one AbortSignal carries both the client's cancel and the deadline, each with its own reason.
 */
import { ShoalError } from '../errors.ts'
import type { GenerateRequest } from '../service.ts'
import type { TextCodec } from '../text/index.ts'
import type { ModelShape } from '../../shards/index.ts'
import { AbortedError, ContextLengthError, DeadlineError } from './errors.ts'

const MAX_TIMER_MS = 2 ** 31 - 1

/** Token ids of the request's prompt, or a typed error (400 / 413) before any work starts. */
export function admitPrompt (codec: TextCodec, request: GenerateRequest, shape: ModelShape): number[] {
  const promptIds = codec.encodePrompt(request.prompt)
  if (promptIds.length === 0) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', 'the prompt is empty')
  const bad = promptIds.find(id => !Number.isSafeInteger(id) || id < 0 || id >= shape.vocabSize)
  if (bad !== undefined) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', `token id ${bad} is outside the vocabulary (0..${shape.vocabSize - 1})`)
  if (promptIds.length >= shape.maxPositions) {
    throw new ContextLengthError(`the prompt has ${promptIds.length} tokens; this model's context is ${shape.maxPositions} tokens, including the completion`)
  }
  if (Date.now() >= request.deadline) throw new DeadlineError()
  return promptIds
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
