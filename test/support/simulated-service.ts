/**
 * A SIMULATED inference service for control-plane tests (HTTP ingress, routing): no model, no
 * engine. Its tokenizer is UTF-8 bytes (token id = byte value, vocabulary 256), its chat template
 * is `<|role|>\ncontent\n… <|assistant|>\n`, and it "generates" a scripted reply byte by byte.
 * Deterministic; it can be told to fail before start, fail after N tokens, stall, or go slowly.
 * (Routing's stand-in for a peer, with hashed tokens and per-request hooks, is simulated-peer.ts.)
 */
import { ShoalError, type ShoalErrorCode } from '../../daemon/errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard, PromptInput } from '../../daemon/service.ts'
import { sleep, untilOrAbort } from './abortable.ts'

export interface SimulatedScript {
  /** The text generated (then finish 'stop'). Default 'Hello from the simulated engine.' */
  reply?: string
  /** Throw a ShoalError with this code before the start event. */
  failBeforeStart?: ShoalErrorCode
  /** Throw after this many generated tokens (after start). */
  failAfterTokens?: number
  /** Code for failAfterTokens; default SHOAL_ERR_NO_ELIGIBLE_NODE (a peer vanished mid-stream). */
  failCode?: ShoalErrorCode
  /** Before start: wait until aborted, or forever (ignoring the signal, like a hung peer). */
  stallBeforeStart?: 'until-abort' | 'forever'
  /** After this many tokens, wait for `until` (or an abort) before going on: a deterministic mid-stream pause. */
  hold?: { afterTokens: number, until: Promise<unknown> }
  /** Pace per token; overrides the service's tokensPerSecond. */
  tokensPerSecond?: number
  /** The route reported in the start event. Default ['sim-node']. */
  route?: string[]
}

export interface SimulatedServiceInit {
  models: Array<string | (Partial<ModelCard> & { id: string })>
  /** 0 or undefined: as fast as the consumer reads. */
  tokensPerSecond?: number
  script?: SimulatedScript | ((request: GenerateRequest) => SimulatedScript)
}

export interface SimulatedCall {
  request: GenerateRequest
  signal: AbortSignal
  /** Settles when the generation stops, however it stops. */
  outcome: Promise<'completed' | 'aborted' | 'failed'>
}

export interface SimulatedService extends InferenceService {
  readonly calls: SimulatedCall[]
}

export const SIMULATED_DEFAULT_REPLY = 'Hello from the simulated engine.'
const encoder = new TextEncoder()

/** The simulated tokenizer and chat template, exported so tests can compute expected ids. */
export function simulatedPromptIds (prompt: PromptInput): number[] {
  if (prompt.kind === 'tokens') return prompt.ids
  const text = prompt.kind === 'text'
    ? prompt.text
    : prompt.messages.map(m => `<|${m.role}|>\n${m.content}\n`).join('') + '<|assistant|>\n'
  return [...encoder.encode(text)]
}

export function createSimulatedService (init: SimulatedServiceInit): SimulatedService {
  const cards: ModelCard[] = init.models.map(m => {
    const c = typeof m === 'string' ? { id: m } : m
    return { created: 1_700_000_000, ownedBy: 'shoal', contextLength: 2048, description: 'simulated engine (tests)', servedBy: ['sim-node'], ...c }
  })
  const calls: SimulatedCall[] = []

  async function * run (request: GenerateRequest, signal: AbortSignal, settle: (o: 'completed' | 'aborted' | 'failed') => void): AsyncGenerator<GenerateEvent> {
    let completed = false
    try {
      const script = typeof init.script === 'function' ? init.script(request) : (init.script ?? {})
      const card = cards.find(c => c.id === request.model)
      if (card === undefined) throw new ShoalError('SHOAL_ERR_MODEL_NOT_FOUND', `The model '${request.model}' does not exist`)
      if (script.stallBeforeStart === 'forever') await new Promise(() => {})
      if (script.stallBeforeStart === 'until-abort') await sleep(2 ** 31 - 1, signal)
      if (script.failBeforeStart !== undefined) throw new ShoalError(script.failBeforeStart, `simulated failure (${script.failBeforeStart})`)
      const promptIds = simulatedPromptIds(request.prompt)
      const bad = promptIds.findIndex(id => !Number.isInteger(id) || id < 0 || id > 255)
      if (bad >= 0) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', `Token id ${promptIds[bad]} is outside the vocabulary (256)`)
      const room = card.contextLength - promptIds.length
      if (room <= 0 || (request.maxTokens !== undefined && request.maxTokens > room)) {
        throw new ShoalError('SHOAL_ERR_CONTEXT_LENGTH', `This model's maximum context length is ${card.contextLength} tokens; the prompt has ${promptIds.length}` +
          (request.maxTokens === undefined ? '' : ` and ${request.maxTokens} more were requested`))
      }
      yield { type: 'start', promptTokenIds: promptIds, route: script.route ?? ['sim-node'], receiptId: request.requestId }

      const replyIds = [...encoder.encode(script.reply ?? SIMULATED_DEFAULT_REPLY)]
      const limit = Math.min(request.maxTokens ?? room, room)
      const tps = script.tokensPerSecond ?? init.tokensPerSecond ?? 0
      const holdBack = Math.max(0, ...request.stop.map(s => s.length - 1))
      const decoder = new TextDecoder('utf-8')
      let full = ''
      let emitted = 0
      let pendingIds: number[] = []
      let generated = 0
      const usage = (): { promptTokens: number, completionTokens: number } => ({ promptTokens: promptIds.length, completionTokens: generated })

      while (true) {
        if (generated === replyIds.length || generated === limit) {
          full += decoder.decode()
          if (full.length > emitted || pendingIds.length > 0) yield { type: 'delta', text: full.slice(emitted), tokenIds: pendingIds }
          completed = true
          yield { type: 'end', finishReason: generated === replyIds.length ? 'stop' : 'length', usage: usage() }
          return
        }
        if (script.failAfterTokens !== undefined && generated >= script.failAfterTokens) {
          const code = script.failCode ?? 'SHOAL_ERR_NO_ELIGIBLE_NODE'
          throw new ShoalError(code, `simulated failure after ${generated} tokens (${code})`)
        }
        if (script.hold !== undefined && generated === script.hold.afterTokens) await untilOrAbort(script.hold.until, signal)
        if (Date.now() > request.deadline) throw new ShoalError('SHOAL_ERR_DEADLINE', 'deadline passed')
        if (tps > 0) await sleep(1000 / tps, signal)
        if (signal.aborted) throw signal.reason
        const id = replyIds[generated] as number
        generated++
        pendingIds.push(id)
        full += decoder.decode(new Uint8Array([id]), { stream: true })
        const hits = request.stop.map(s => full.indexOf(s)).filter(i => i >= 0)
        if (hits.length > 0) {
          const cut = Math.min(...hits)
          yield { type: 'delta', text: full.slice(emitted, Math.max(cut, emitted)), tokenIds: pendingIds }
          completed = true
          yield { type: 'end', finishReason: 'stop', usage: usage() }
          return
        }
        // Hold back text that could be the start of a stop sequence.
        const safe = Math.max(emitted, full.length - holdBack)
        if (safe > emitted) {
          yield { type: 'delta', text: full.slice(emitted, safe), tokenIds: pendingIds }
          emitted = safe
          pendingIds = []
        }
      }
    } finally {
      settle(completed ? 'completed' : signal.aborted ? 'aborted' : 'failed')
    }
  }

  return {
    calls,
    models: () => cards.map(c => ({ ...c })),
    generate (request, signal) {
      let settle!: (o: 'completed' | 'aborted' | 'failed') => void
      const outcome = new Promise<'completed' | 'aborted' | 'failed'>(resolve => { settle = resolve })
      calls.push({ request, signal, outcome })
      return run(request, signal, settle)
    },
  }
}
