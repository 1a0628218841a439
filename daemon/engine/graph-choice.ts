/**
 * Which of a stage's graphs the engine runs: the dynamic graph (any shape, the default) or the
 * static pair (`shoal shard --static`), which devices that compile only fixed shapes (NPUs) need
 * and any device may be told to use. A pure decision over the manifest and the device, so it is
 * tested without a backend.
 */
import { join } from 'node:path'
import type { ShardManifest } from '../../shards/contract.ts'
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

export type GraphChoice = { kind: 'dynamic', graph: string } | ({ kind: 'static' } & StaticGraphChoice)

export function chooseStageGraphs (manifest: ShardManifest, stageIndex: number, device: string, mode: GraphMode = 'auto'): GraphChoice {
  const st = manifest.stages[stageIndex]
  if (st === undefined) throw new EngineError(`shard manifest has no stage ${stageIndex}`)
  const wantStatic = mode === 'static' || (mode === 'auto' && needsStaticShapes(device))
  if (!wantStatic) return { kind: 'dynamic', graph: st.graph }
  if (st.static === undefined || manifest.static === undefined) {
    const why = mode === 'static' ? 'static graphs were asked for' : `device ${device} compiles only static shapes`
    throw new EngineError(`${why}, but stage ${stageIndex} of ${manifest.modelId} has none: compile it with shoal shard --static CTX[,CHUNK]`)
  }
  return { kind: 'static', prefill: st.static.prefill, decode: st.static.decode, contextLength: manifest.static.contextLength, chunk: manifest.static.chunk }
}

/** Absolute paths of a choice, for the engine worker. */
export function resolveGraphChoice (shardDir: string, choice: GraphChoice): { graphPath: string, staticGraphs?: StaticGraphChoice } {
  const abs = (p: string): string => join(shardDir, ...p.split('/'))
  if (choice.kind === 'dynamic') return { graphPath: abs(choice.graph) }
  return { graphPath: abs(choice.prefill), staticGraphs: { prefill: abs(choice.prefill), decode: abs(choice.decode), contextLength: choice.contextLength, chunk: choice.chunk } }
}

/** The stage as the chosen graphs run it: on static graphs the context limit is the KV budget, and steps never batch. */
export function stageInfoFor (info: StageInfo, choice: GraphChoice): StageInfo {
  if (choice.kind === 'dynamic') return info
  return { ...info, maxPositions: staticContextLimit(info, choice), batchPadding: 'none' }
}
