/**
 * The per-request skeleton every generation service shares — the local engine's and a pipeline
 * coordinator's: the service is running, the model is the one asked for, the prompt is admitted,
 * the request takes a slot, one scope carries the client's cancel and the deadline, the token
 * source starts and prefills before `start` (so a refusal is still a plain HTTP error), the decode
 * loop runs, an abort ends with its reason, and the request's resources come back exactly once.
 * What differs — how a slot is taken, where the tokens come from, what the end carries — is the
 * service's, through `GenerationHost` and the `RequestTicket` it hands out per request.
 */
import type { GenerateEvent, GenerateRequest, SpeculationSummary } from '../service.ts'
import type { TextCodec } from '../text/index.ts'
import type { ModelShape } from '../../shards/index.ts'
import { ModelNotFoundError, ShuttingDownError } from './errors.ts'
import { afterPrefill, endConditions, generateSequence } from './generate.ts'
import type { TokenSource } from './generate.ts'
import { admitPrompt, requestScope } from './request-scope.ts'
import { abortReason } from './stage-engine.ts'

type StartEvent = Extract<GenerateEvent, { type: 'start' }>
type EndEvent = Extract<GenerateEvent, { type: 'end' }>

/** What a service runs now: the model's id, its text codec and its limits. */
export interface RunningModel {
  modelId: string
  codec: TextCodec
  manifest: { shape: ModelShape, generation: { eosTokenIds: number[] } }
}

export interface GenerationHost<M extends RunningModel> {
  /** The model served now; undefined when the service is not running. */
  current (): M | undefined
  /** The ShuttingDownError's message when `current` is undefined. */
  notRunning: string
  /**
   * Once the prompt is admitted: synchronous checks (a stopping service, a full coordinator) and
   * the request's ticket. `model` is what `current` returned when the request arrived.
   */
  admit (request: GenerateRequest, promptIds: number[], model: M): RequestTicket
  /**
   * Release the request's resources as soon as its scope aborts, not only when its stream ends,
   * so they come back even when a consumer abandons the iterator without closing it.
   */
  releaseOnAbort?: boolean
}

/** One admitted request, before its token source exists. */
export interface RequestTicket {
  /** Takes the request's slot and starts its token source (the token-source factory); called once. */
  open (signal: AbortSignal): Promise<RequestRun>
  /** Gives everything back; runs once, after the scope is disposed, whatever `open` reached. */
  release (): Promise<void>
}

/** A started request: its tokens and what the events around them carry. */
export interface RequestRun {
  source: TokenSource
  /** The prompt is in the sequence (or there was nothing to prefill): called before `start`. */
  prefilled? (): void
  /** The `start` event's fields besides the prompt, read after the prefill (a chain may have been re-formed). */
  start (): Omit<StartEvent, 'type' | 'promptTokenIds'>
  /** Each delta's token ids, before the delta goes out. */
  delta? (tokenIds: number[]): void
  /** What speculative decoding did, for the end event. */
  summary? (): SpeculationSummary | undefined
  /** Completes the end event (e.g. the stages' receipt parts). */
  end? (event: EndEvent, signal: AbortSignal): Promise<EndEvent>
}

/** Prompt positions below which a prefill's time says more about per-run overhead than about speed. */
const MIN_RATE_TOKENS = 64

/**
 * A service's measured prefill rate updated with one request's prefill (`computed` positions in
 * `ms`), an exponential moving average; unchanged when the sample is too short to say anything
 * or the request asked for no tokens (nothing was prefilled).
 */
export function updatePrefillRate (rate: number | undefined, request: Pick<GenerateRequest, 'maxTokens'>, computed: number, ms: number): number | undefined {
  if ((request.maxTokens !== undefined && request.maxTokens <= 0) || computed < MIN_RATE_TOKENS || ms <= 0) return rate
  const r = computed / ms * 1000
  return rate === undefined ? r : 0.7 * rate + 0.3 * r
}

export interface GenerationService {
  generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent>
}

export function createGenerationService<M extends RunningModel> (host: GenerationHost<M>): GenerationService {
  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent> {
    const model = host.current()
    if (model === undefined) throw new ShuttingDownError(host.notRunning)
    if (request.model !== model.modelId) throw new ModelNotFoundError(request.model, [model.modelId])
    const promptIds = await admitPrompt(model.codec, request, model.manifest.shape, signal)
    const ticket = host.admit(request, promptIds, model)
    const scope = requestScope(signal, request.deadline)
    let released: Promise<void> | undefined
    const release = async (): Promise<void> => {
      released ??= (async () => {
        scope.dispose()
        await ticket.release()
      })()
      await released
    }
    if (host.releaseOnAbort === true) scope.signal.addEventListener('abort', () => { void release() }, { once: true })
    try {
      const run = await ticket.open(scope.signal)
      // Prefill before `start`: an overloaded batcher or a chain that cannot be completed is then
      // an HTTP error, not a broken stream.
      const first = request.maxTokens === undefined || request.maxTokens > 0
        ? await run.source.prefill(promptIds, scope.signal, afterPrefill(request.maxTokens, model.manifest.shape.maxPositions, promptIds.length))
        : undefined
      run.prefilled?.()
      yield { type: 'start', promptTokenIds: promptIds, ...run.start() }
      const events = generateSequence({
        source: run.source, first, codec: model.codec, promptIds, ...endConditions(request, model.manifest), signal: scope.signal,
      })
      for await (const event of events) {
        if (event.type === 'delta') run.delta?.(event.tokenIds)
        if (event.type !== 'end') {
          yield event
          continue
        }
        // The receipt records what speculation did (drafter, proposed and accepted tokens).
        const summary = run.summary?.()
        const withSpeculation = summary === undefined ? event : { ...event, speculation: summary }
        yield run.end === undefined ? withSpeculation : await run.end(withSpeculation, scope.signal)
      }
    } catch (err) {
      throw scope.signal.aborted ? abortReason(scope.signal) : err
    } finally {
      await release()
    }
  }
  return { generate }
}
