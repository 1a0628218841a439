/**
 * Which of a stage's graphs the engine runs: the dynamic graph (any shape, the default) or the
 * static pair (`shoal shard --static`), which devices that compile only fixed shapes (NPUs) need
 * and any device may be told to use. A pure decision over the manifest and the device, so it is
 * tested without a backend. Also what a stage's engine is told of it (StageInfo): the manifest's
 * shape and batching rule (stageInfoOf), narrowed to the chosen graphs (stageInfoFor).
 */
import { join } from 'node:path'
import { STAGE_DATA_FILE, type ShardManifest, type StageManifest } from '../../shards/contract.ts'
import type { BackendName } from './backend/types.ts'
import { EngineError } from './errors.ts'
import type { StageInfo } from './protocol.ts'
import { staticContextLimit } from './static-runner.ts'

/** 'auto' (default): static exactly where the device needs it; 'static' / 'dynamic': as told. */
export type GraphMode = 'auto' | 'static' | 'dynamic'

export const GRAPH_MODES: readonly GraphMode[] = ['auto', 'static', 'dynamic']

/** Devices whose compilers take only static shapes: OpenVINO's NPU plugin (NPU, NPU.0, …). */
export function needsStaticShapes (device: string): boolean {
  return /^NPU(\.\d+)?$/i.test(device)
}

/** Where the static pair is, with its fixed shapes (paths relative to the shard directory). */
export interface StaticGraphChoice {
  prefill: string
  decode: string
  contextLength: number
  chunk: number
}

/** The dynamic graph, and its one-position graph beside it where that is worth a second session (decodeGraphWanted). */
export type GraphChoice = { kind: 'dynamic', graph: string, decodeGraph?: string } | ({ kind: 'static' } & StaticGraphChoice)

/**
 * Stages whose weights are at most this many bytes run one-position steps on their own graph
 * (StageManifest.decodeGraph) where the backend is onnxruntime. Why: it spares every layer's If,
 * ~7 µs each — 3–5 % of a one-row 60m int4 step, 1–3 % at eight rows, bit-identical — but the
 * second session packs every weight again (onnxruntime-node shares no prepacked weights between
 * sessions). Small weights are where the Ifs are a visible share of a step and the copy is cheap
 * (60m int4, 35 MiB: +45 MB of RSS); bigger models gain ~0.5–2 % (60m fp32, 250m int4) for 150–220 MiB
 * more, and 250m must stay within 1.5× its weights (docs/engine-notes.md, wave 28).
 */
export const DECODE_GRAPH_MAX_WEIGHT_BYTES = 64 * 1024 * 1024

/** Whether a stage runs one-position steps on its one-position graph (a pure decision over the manifest and the backend). */
export function decodeGraphWanted (stage: StageManifest, backend: BackendName): boolean {
  if (stage.decodeGraph === undefined || backend !== 'onnxruntime') return false
  const weights = stage.files.find(f => f.path === `${stage.dir}/${STAGE_DATA_FILE}`)
  return weights !== undefined && weights.bytes <= DECODE_GRAPH_MAX_WEIGHT_BYTES
}

export function chooseStageGraphs (manifest: ShardManifest, stageIndex: number, device: string, mode: GraphMode = 'auto', backend: BackendName = 'onnxruntime'): GraphChoice {
  const st = manifest.stages[stageIndex]
  if (st === undefined) throw new EngineError(`shard manifest has no stage ${stageIndex}`)
  const wantStatic = mode === 'static' || (mode === 'auto' && needsStaticShapes(device))
  if (!wantStatic) return decodeGraphWanted(st, backend) ? { kind: 'dynamic', graph: st.graph, decodeGraph: st.decodeGraph } : { kind: 'dynamic', graph: st.graph }
  if (st.static === undefined || manifest.static === undefined) {
    const why = mode === 'static' ? 'static graphs were asked for' : `device ${device} compiles only static shapes`
    throw new EngineError(`${why}, but stage ${stageIndex} of ${manifest.modelId} has none: compile it with shoal shard --static CTX[,CHUNK]`)
  }
  return { kind: 'static', prefill: st.static.prefill, decode: st.static.decode, contextLength: manifest.static.contextLength, chunk: manifest.static.chunk }
}

/** Absolute paths of a choice, for the engine worker. */
export function resolveGraphChoice (shardDir: string, choice: GraphChoice): { graphPath: string, decodeGraphPath?: string, staticGraphs?: StaticGraphChoice } {
  const abs = (p: string): string => join(shardDir, ...p.split('/'))
  if (choice.kind === 'dynamic') return choice.decodeGraph === undefined ? { graphPath: abs(choice.graph) } : { graphPath: abs(choice.graph), decodeGraphPath: abs(choice.decodeGraph) }
  return { graphPath: abs(choice.prefill), staticGraphs: { prefill: abs(choice.prefill), decode: abs(choice.decode), contextLength: choice.contextLength, chunk: choice.chunk } }
}

/** The stage as the chosen graphs run it: on static graphs the context limit is the KV budget, and steps never batch. */
export function stageInfoFor (info: StageInfo, choice: GraphChoice): StageInfo {
  if (choice.kind === 'dynamic') return info
  return { ...info, maxPositions: staticContextLimit(info, choice), batchPadding: 'none' }
}

/** A stage of a manifest as its engine sees it: which ends it holds, the model's shape, and how its rows may batch. */
export function stageInfoOf (manifest: ShardManifest, index = 0): StageInfo {
  const st = manifest.stages[index]
  if (st === undefined) throw new EngineError(`shard manifest has no stage ${index}`)
  const s = manifest.shape
  return {
    hasEmbedding: st.hasEmbedding,
    hasHead: st.hasHead,
    layers: st.layers,
    hiddenSize: s.hiddenSize,
    numKvHeads: s.numKvHeads,
    headDim: s.headDim,
    vocabSize: s.vocabSize,
    maxPositions: s.maxPositions,
    batchPadding: batchPaddingOf(manifest),
  }
}

/**
 * Graphs with per-row attention lengths ('right', the compiler's default since version 4) batch
 * any mix of lengths bit-exactly, whatever their activations. Standard-op graphs are exact under
 * left padding up to float rounding (masked scores become the lowest f32, whose softmax weight is
 * exactly 0). Other op tables batch only when their manifest says so. Left-padded graphs with int8
 * activations turn that rounding into different tokens, so they batch only sequences whose caches
 * are equally long (no padding at all).
 */
function batchPaddingOf (manifest: ShardManifest): 'left' | 'right' | 'equal' | 'none' {
  if ((manifest as { batchPadding?: unknown }).batchPadding === 'right') return 'right'
  const padded = manifest.opSet === 'standard' || (manifest as { batchPadding?: unknown }).batchPadding === 'left'
  if (!padded) return 'none'
  const q = manifest.quantization
  // Absent (compilers before version 3): int8, then the only kind.
  return q.kind !== 'none' && q.activations !== 'f32' ? 'equal' : 'left'
}
