/**
 * SimulatedEngine: a SIMULATED inference engine for control-plane benchmarks (routing, forwarding,
 * ingress) — no weights, no compute. It implements the InferenceService contract of
 * daemon/service.ts like a batched engine would: up to `slots` sequences decode together, one
 * token each per step of `msPerToken` (a batcher's step takes the same time whatever the batch
 * size, so N slots give N× one sequence's rate); requests beyond the slots wait in a FIFO queue
 * (bounded; past it SHOAL_ERR_OVERLOADED). Steps run on a wall-clock grid, like an accelerator
 * computing beside the event loop: when the JS thread stalls, tokens are computed anyway and go
 * out when it resumes, so the simulated compute is exact and what falls short is the control
 * plane's doing. One timer per engine, never a busy loop, so many engines in one process are cheap. The tokenizer is UTF-8 bytes; the generated tokens are a deterministic
 * function of the prompt and position. It reports its live load in the mesh's LoadRecord shape.
 */
import { ShoalError } from '../daemon/errors.ts'
import type { LoadRecord } from '../daemon/mesh/index.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard, PromptInput } from '../daemon/service.ts'

export interface SimulatedEngineInit {
  model: string
  /** Named in the start event's route. */
  nodeId: string
  /** One decode step (every running sequence gets one token). Default 20 ms. */
  msPerToken?: number
  /** Sequences decoded together. Default 10. */
  slots?: number
  /** Requests waiting for a slot before new ones are refused. Default 256. */
  maxQueue?: number
  contextLength?: number
}

export interface SimulatedEngineStats {
  tokens: number
  completed: number
  refused: number
}

export interface SimulatedEngine extends InferenceService {
  /** Live load as the mesh's load protocol carries it. */
  load(): LoadRecord
  stats(): SimulatedEngineStats
  stop(): void
}

const encoder = new TextEncoder()

function promptIds (prompt: PromptInput): number[] {
  if (prompt.kind === 'tokens') return prompt.ids
  const text = prompt.kind === 'text' ? prompt.text : prompt.messages.map(m => `<|${m.role}|>\n${m.content}\n`).join('') + '<|assistant|>\n'
  return [...encoder.encode(text)]
}

/** A deterministic "next token": a hash of the prompt and the position, as a printable byte. */
function tokenAt (seed: number, i: number): number {
  let h = (seed ^ Math.imul(i + 1, 0x9e3779b1)) >>> 0
  h = Math.imul(h ^ (h >>> 15), 0x85ebca6b) >>> 0
  return 97 + (h % 26)
}

interface Sequence {
  /** Resolves the consumer's wait for its next token. */
  wake?: () => void
  /** The engine step in which this sequence's prefill ran; its first token comes one step later. */
  joinStep: number
  /** Tokens handed to the consumer so far. */
  taken: number
  /** Admitted to a slot. */
  running: boolean
  admit?: () => void
}

export function createSimulatedEngine (init: SimulatedEngineInit): SimulatedEngine {
  const msPerToken = init.msPerToken ?? 20
  const slots = init.slots ?? 10
  const maxQueue = init.maxQueue ?? 256
  const contextLength = init.contextLength ?? 4096
  const running = new Set<Sequence>()
  const waiting: Sequence[] = []
  const stats: SimulatedEngineStats = { tokens: 0, completed: 0, refused: 0 }
  let timer: ReturnType<typeof setTimeout> | undefined
  /** Steps run on a wall-clock grid from here: compute does not stall when the event loop does. */
  const epoch = Date.now()
  /** Mean request duration (ms, EWMA), for the queue-wait estimate. */
  let meanServiceMs = 64 * msPerToken

  const stepNow = (): number => Math.floor((Date.now() - epoch) / msPerToken)
  /** Tokens a sequence has been computed by now: one per step after its prefill step. */
  const earned = (s: Sequence): number => Math.max(0, stepNow() - s.joinStep)

  /** Wakes every consumer with a token waiting; ticks again at the next step while anyone runs. */
  const tick = (): void => {
    timer = undefined
    for (const s of running) {
      if (s.wake !== undefined && earned(s) > s.taken) {
        const wake = s.wake
        s.wake = undefined
        wake()
      }
    }
    schedule()
  }
  const schedule = (): void => {
    if (timer !== undefined || running.size === 0) return
    const next = epoch + (stepNow() + 1) * msPerToken
    timer = setTimeout(tick, Math.max(0, next - Date.now()))
  }
  /** A sequence takes a slot: its prefill is the next step. */
  const join = (s: Sequence): void => {
    s.running = true
    s.joinStep = stepNow() + 1
    running.add(s)
    schedule()
  }
  const admitWaiting = (): void => {
    while (running.size < slots && waiting.length > 0) {
      const s = waiting.shift()!
      join(s)
      s.admit?.()
    }
  }
  const release = (s: Sequence): void => {
    if (s.running) running.delete(s)
    else {
      const i = waiting.indexOf(s)
      if (i >= 0) waiting.splice(i, 1)
    }
    s.running = false
    admitWaiting()
  }

  const untilAbort = async (signal: AbortSignal, register: (resolve: () => void) => void): Promise<void> => {
    if (signal.aborted) throw signal.reason
    await new Promise<void>((resolve, reject) => {
      const onAbort = (): void => { reject(signal.reason) }
      signal.addEventListener('abort', onAbort, { once: true })
      register(() => { signal.removeEventListener('abort', onAbort); resolve() })
    })
  }

  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent, void, undefined> {
    if (request.model !== init.model) throw new ShoalError('SHOAL_ERR_MODEL_NOT_FOUND', `model "${request.model}" does not exist here`)
    const ids = promptIds(request.prompt)
    if (ids.length >= contextLength) throw new ShoalError('SHOAL_ERR_CONTEXT_LENGTH', `the prompt has ${ids.length} tokens; the context is ${contextLength}`)
    if (running.size >= slots && waiting.length >= maxQueue) {
      stats.refused++
      throw new ShoalError('SHOAL_ERR_OVERLOADED', `all ${slots} slots busy and ${waiting.length} requests queued`)
    }
    const startedAt = Date.now()
    const seq: Sequence = { joinStep: 0, taken: 0, running: false }
    let released = false
    const done = (): void => { if (!released) { released = true; release(seq) } }
    try {
      if (running.size < slots && waiting.length === 0) {
        join(seq)
      } else {
        waiting.push(seq)
        await untilAbort(signal, resolve => { seq.admit = resolve })
      }
      yield { type: 'start', promptTokenIds: ids, route: [init.nodeId], receiptId: request.requestId }
      const limit = Math.min(request.maxTokens ?? 16, contextLength - ids.length)
      const seed = ids.reduce((h, id) => Math.imul(h ^ id, 16777619) >>> 0, 2166136261)
      for (let i = 0; i < limit; i++) {
        if (signal.aborted) throw signal.reason
        if (earned(seq) <= seq.taken) await untilAbort(signal, resolve => { seq.wake = resolve })
        if (Date.now() > request.deadline) throw new ShoalError('SHOAL_ERR_DEADLINE', 'deadline passed')
        seq.taken++
        const id = tokenAt(seed, i)
        stats.tokens++
        yield { type: 'delta', text: String.fromCharCode(id), tokenIds: [id] }
      }
      // The slot is free as soon as the last token is out: a consumer that never closes the
      // generator after `end` must not hold it.
      done()
      stats.completed++
      meanServiceMs += 0.1 * ((Date.now() - startedAt) - meanServiceMs)
      yield { type: 'end', finishReason: 'length', usage: { promptTokens: ids.length, completionTokens: limit } }
    } finally {
      done()
    }
  }

  return {
    models (): ModelCard[] {
      return [{ id: init.model, created: 0, ownedBy: 'shoal', contextLength, description: 'simulated engine (benchmarks)', servedBy: [init.nodeId] }]
    },
    generate,
    load (): LoadRecord {
      const free = slots - running.size
      const ahead = waiting.length + 1 - free
      return {
        queueDepth: waiting.length,
        inFlight: running.size,
        // Capacity, not recent demand: an idle engine is not a slow one.
        decodeTokPerSec: (slots * 1000) / msPerToken,
        freeKvTokens: 0,
        expectedWaitMs: ahead > 0 ? Math.ceil(ahead / slots) * meanServiceMs : 0,
        slots,
        accepting: waiting.length < maxQueue,
      }
    },
    stats: () => ({ ...stats }),
    stop () {
      if (timer !== undefined) clearTimeout(timer)
      timer = undefined
      running.clear()
    },
  }
}
