/**
 * onnxruntime-node backend (CPU execution provider). Always available: it is a dependency.
 */
import { readFile } from 'node:fs/promises'
import { availableParallelism } from 'node:os'
import { dirname } from 'node:path'
import * as ort from 'onnxruntime-node'
import { EngineError } from '../errors.ts'
import { stepMark } from '../../step-trace.ts'
import { loadKernelLibrary } from '../native/load.ts'
import { f32KernelFits } from '../native/build.ts'
import { f32ProductsExact } from '../native/f32-check.ts'
import { greedyHeadExact } from '../native/head-check.ts'
import { LOGITS_WANTED, swapKernels } from '../native/swap.ts'
import { LOGITS } from '../../../shards/contract.ts'
import type { Backend, BackendSession, HostTensor, LoadOptions, TensorMap } from './types.ts'

export function createOnnxruntimeBackend (): Backend {
  return {
    name: 'onnxruntime',
    devices: () => ['CPU'],
    async load (graphPath, options) {
      if (options.device !== 'CPU') {
        throw new EngineError(`onnxruntime backend has no device "${options.device}" (devices: CPU)`)
      }
      let loaded: Loaded
      try {
        loaded = await loadSession(graphPath, options, { head: true, f32: await f32KernelFits() })
      } catch (err) {
        throw new EngineError(`onnxruntime could not load ${graphPath}: ${(err as Error).message}`, { cause: err })
      }
      return wrap(loaded)
    },
  }
}

/**
 * An onnxruntime session of the graph at `graphPath` made with sessionOptions: as compiled, or with
 * `kernels` (the library's path) its int4 products, one-position attention and verify steps on
 * shoal's kernels (native/swap.ts). Engines and the session worker's graphs (MoE experts) alike.
 */
export async function createOrtSession (graphPath: string, options: Pick<LoadOptions, 'threads' | 'exclusiveCores' | 'kernels'>): Promise<ort.InferenceSession> {
  return (await loadSession(graphPath, options)).session
}

/** A loaded session, how many attention nodes it runs on shoal's kernel, and whether its head's greedy token does (swapHead). */
interface Loaded { session: ort.InferenceSession, attention: number, head: boolean }

/**
 * createOrtSession's session, with what it runs on shoal's kernels; `swap.head` only where the
 * session is wrapped (wrap feeds the head's flag, swapKernels).
 */
async function loadSession (graphPath: string, options: Pick<LoadOptions, 'threads' | 'exclusiveCores' | 'kernels'>, swap: { head?: boolean, f32?: boolean } = {}): Promise<Loaded> {
  return options.kernels === undefined ? { session: await ort.InferenceSession.create(graphPath, sessionOptions(options)), attention: 0, head: false } : await withKernels(graphPath, options.kernels, options, swap)
}

/**
 * The graph at `graphPath` with its int4 products, one-position attention and verify steps on shoal's kernels
 * (native/swap.ts), and with `swap` an f32 head's greedy token and f32 layer products, where their
 * self-checks pass; loaded from memory: its external weights are read from the graph's own
 * directory, as from the file.
 */
async function withKernels (graphPath: string, lib: string, options: Pick<LoadOptions, 'threads' | 'exclusiveCores'>, swap: { head?: boolean, f32?: boolean }): Promise<Loaded> {
  loadKernelLibrary(lib)
  const graph = await readFile(graphPath)
  let swapped = swapKernels(graph, swap)
  // The head only where GreedyHead gives onnxruntime's bits here (head-check.ts), asked only of
  // graphs that have one (an int4 model's never does).
  if (swapped.head > 0 && !await greedyHeadExact(lib)) swapped = swapKernels(graph, { ...swap, head: false })
  // The f32 products only where MatMulF32 gives MatMul's bits here (f32-check.ts).
  if (swapped.f32 > 0 && !await f32ProductsExact(lib)) swapped = swapKernels(graph, { ...swap, head: swapped.head > 0, f32: false })
  const { bytes, int4, attention, steps, head, f32 } = swapped
  if (int4 + attention + steps + head + f32 === 0) return { session: await ort.InferenceSession.create(graphPath, sessionOptions(options)), attention, head: false }
  const base = sessionOptions(options)
  const extra = base.extra as { session: Record<string, unknown> }
  return { session: await ort.InferenceSession.create(bytes, { ...base, extra: { ...extra, session: { ...extra.session, model_external_initializers_file_folder_path: dirname(graphPath) } } }), attention, head: head > 0 }
}

/** The options every engine session is made with (benchmarks and the kernel probe's sessions too, so they time what serves). */
export function sessionOptions (options: Pick<LoadOptions, 'threads' | 'exclusiveCores'>): ort.InferenceSession.SessionOptions {
  return {
    executionProviders: ['cpu'],
    graphOptimizationLevel: 'all',
    intraOpNumThreads: options.threads ?? availableParallelism(),
    interOpNumThreads: 1,
    executionMode: 'sequential',
    logSeverityLevel: 3,
    extra: spinning(options.exclusiveCores === true),
  }
}

/**
 * Intra-op threads spin while a run is in progress and stop the moment it returns
 * (`session.force_spinning_stop`), unless the session has the cores to itself, when they spin
 * between runs too. Why: a decode step is ~100–300 short kernels, and an intra-op thread that
 * sleeps between them is woken ~10–20 µs late every time (33 MatMulNBits alone: 1.5–2.0 ms a step
 * with sleeping threads, 1.2–1.4 spinning); a thread that keeps spinning after the run takes the
 * core from the main thread that streams the tokens and from the other sessions of the process.
 * Spinning only within a run measured faster in all three cases — one session, two alternating,
 * two concurrent (docs/engine-notes.md). Flattened by the binding into session config keys.
 */
export function spinning (exclusiveCores: boolean): Record<string, unknown> {
  return { session: { intra_op: { allow_spinning: '1' }, force_spinning_stop: exclusiveCores ? '0' : '1' } }
}

/** A swapped head's flag (native/swap.ts swapHead): a run that fetches no logits skips the head's product. */
const NO_LOGITS = new ort.Tensor('bool', [false], [])
const WITH_LOGITS = new ort.Tensor('bool', [true], [])

function wrap ({ session, attention, head }: Loaded): BackendSession {
  let closed = false
  const liveColumnsOnly = attention > 0
  return {
    // The head's flag is this wrapper's to feed, not the runners'.
    inputNames: head ? session.inputNames.filter(n => n !== LOGITS_WANTED) : session.inputNames,
    outputNames: session.outputNames,
    liveColumnsOnly,
    async run (feeds, fetches) {
      if (closed) throw new EngineError('session is closed')
      stepMark('ort.feeds')
      const ortFeeds: Record<string, ort.Tensor> = {}
      for (const [name, t] of Object.entries(feeds)) ortFeeds[name] = new ort.Tensor(t.type, t.data, t.dims)
      // A run that names its fetches without the logits (a greedy step's token) skips the head's product.
      if (head) ortFeeds[LOGITS_WANTED] = fetches !== undefined && !fetches.includes(LOGITS) ? NO_LOGITS : WITH_LOGITS
      let out: ort.InferenceSession.ReturnType
      try {
        stepMark('ort.run0')
        // The binding copies every fetched output into a new JS buffer: name only what is read.
        out = fetches === undefined ? await session.run(ortFeeds) : await session.run(ortFeeds, [...fetches])
        stepMark('ort.run1')
      } catch (err) {
        throw new EngineError(`onnxruntime run failed: ${(err as Error).message}`, { cause: err })
      }
      const result: TensorMap = {}
      for (const [name, v] of Object.entries(out)) result[name] = toHost(name, v as ort.Tensor)
      stepMark('ort.out')
      return result
    },
    async close () {
      if (closed) return
      closed = true
      await session.release()
    },
  }
}

function toHost (name: string, t: ort.Tensor): HostTensor {
  const dims = [...t.dims]
  if (t.type === 'float32') return { type: 'float32', data: t.data as Float32Array, dims }
  if (t.type === 'int64') return { type: 'int64', data: t.data as BigInt64Array, dims }
  throw new EngineError(`output ${name} has unsupported type ${t.type}`)
}
