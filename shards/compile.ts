/**
 * The shard compiler: HF checkpoint directory → per-stage ONNX graphs (weights as one external
 * data file per stage), tokenizer files, and manifest.json with layer ranges and sha256 hashes.
 */
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { copyFile, mkdir, open, writeFile } from 'node:fs/promises'
import { basename, join, resolve } from 'node:path'
import { normalizeConfig } from './architectures.ts'
import { checkpointHash, readConfig, readGenerationDefaults, TOKENIZER_FILES } from './checkpoint.ts'
import { MANIFEST_FORMAT, STAGE_DATA_FILE, STAGE_DECODE_GRAPH_FILE, STAGE_GRAPH_FILE, type DecodeAttentionForm, type ModelShape, type ShardManifest, type StageManifest, type StaticShapes } from './contract.ts'
import { CheckpointError } from './errors.ts'
import { OP_TABLES, type OpTable } from './graph/ops.ts'
import type { GraphBuilder } from './graph/builder.ts'
import { inlineDecodeBranches } from './graph/decode-graph.ts'
import { buildStage, type StageSource } from './graph/stage.ts'
import { buildStaticStage } from './graph/static.ts'
import { describeFile, writeManifest } from './manifest.ts'
import { quantizationOf } from './quant.ts'
import { openWeights, type F32Tensor } from './safetensors.ts'
import { planStages } from './split.ts'

/**
 * Bumped whenever the graphs this compiler writes, or what its manifest means, change; cached
 * shards from another version are rebuilt. 3: `quantization.activations` is recorded (before, every
 * quantized shard had int8 activations, unrecorded). 4: 'ort-contrib' graphs take right-padded
 * rows with per-row attention lengths (`batchPadding: 'right'`) and are the default op table.
 * 5: 'ort-contrib' graphs also output each step's new KV columns (`new_key_values.*`), and int4
 * shards quantize the token embedding too (`quantization.embedding: 'int4'`). 6: 'ort-contrib'
 * graphs output only `new_key_values.*` (no present) and attend over the past buffer in place in
 * one-position steps. 7: those steps take one query head a product (one-row kernels read the past
 * in place instead of packing it). 8: they also output every layer's new columns as one tensor
 * (`new_key_values`), fetched instead of two outputs a layer. 9: one-position steps run fewer nodes
 * (Reshapes for size-1 transposes; the several-position branch builds its own column index).
 * 10: the last stage also outputs each kept position's greedy token (`greedy_token`). 11: int4
 * shards look the token embedding up in standard ops (its 4-bit bytes gathered and unpacked) instead
 * of GatherBlockQuantized: the same bytes and bits, faster past one row. 12: the one-position
 * attention's form is a compile option ('per-head' as in 7–11, or 'grouped'), recorded as
 * `decodeAttention`; `shoal shard` takes the one this CPU runs faster, the daemon's cache per-head.
 * 13: 'ort-contrib' stages also get a one-position graph, the stage graph with its one-position
 * Ifs inline (`decodeGraph`, shards/graph/decode-graph.ts), reading the same weights file.
 * 14: 4-bit scales are IEEE halves (shards/quant.ts), which shoal's int4 kernel packs in two bytes.
 */
export const COMPILER_VERSION = 14

/** The op table shards are compiled with unless told otherwise. */
export const DEFAULT_OP_SET: OpTable['name'] = 'ort-contrib'
export const STATIC_PREFILL_FILE = 'static-prefill.onnx'
export const STATIC_DECODE_FILE = 'static-decode.onnx'
/** One weights file for both static graphs of a stage (they write the same weights in the same order). */
export const STATIC_DATA_FILE = 'static.onnx.data'
/** The prefill chunk of `--static CTX` without CHUNK (capped at CTX). */
export const DEFAULT_STATIC_CHUNK = 128

export interface CompileOptions {
  modelDir: string
  outDir: string
  stages?: number
  layers?: Array<[number, number]>
  quant?: 'none' | 'int8' | 'int4'
  blockSize?: 32 | 128
  /** Served model id; default: config.json's shoal_model_id, else the checkpoint directory's name. */
  modelId?: string
  /**
   * 'ort-contrib' (default: onnxruntime's fused CPU kernels — a quarter of the kernels per step,
   * and batching of any mix of lengths is bit-exact) or 'standard' (portable opset-17 ONNX).
   */
  opSet?: OpTable['name']
  /**
   * MatMulNBits accuracy_level for quantized stages, recorded in the manifest as
   * `quantization.activations`. 4 (default): int8 activations, faster on CPU (60m int4 here: 2.1
   * vs 3.2 ms a step; ahead at 1–8 concurrent ragged streams too, reproduction/results/batching.md)
   * — the activation quantization would turn a padded batch's last-bit differences into different
   * tokens, so the engine batches such shards only between equally long contexts, unpadded. 0: f32
   * activations, slower per step, batched with any mix of lengths. Both keep every sequence's
   * batch-of-one tokens where the CPU's int4 kernel is row-invariant (AVX-512 VNNI), and are exact
   * to rounding where it is not (AVX2 only: daemon/engine/kernel-probe.ts,
   * test/engine/batched-int4.test.ts).
   */
  accuracyLevel?: 0 | 4
  /**
   * int4 only: the token embedding as 4-bit blocks ('int4', default: the MatMulNBits quantizer's
   * blocks, looked up in standard ops, an eighth of the f32 bytes — the embedding is the largest
   * single tensor of a small int4 model) or kept f32 ('f32'). Recorded as `quantization.embedding`.
   */
  embedding?: 'int4' | 'f32'
  /**
   * int4 'ort-contrib' shards of block 32 at accuracy level 4 only: 'native' writes shoal's
   * MatMulQ4 in place of every MatMulNBits on disk (Quantization.kernel; for tests and benchmarks:
   * nodes make that swap in memory on default shards, daemon/engine/native). Recorded as
   * `quantization.kernel`.
   */
  kernel?: 'native'
  /**
   * 'ort-contrib' only: the one-position attention's form (DecodeAttentionForm; default
   * 'per-head'), or a function that picks it from the model's shape, called once the shape is
   * known and only for 'ort-contrib' graphs. A speed choice, not an accuracy one: which form is
   * faster depends on the CPU (daemon/engine/kernel-probe.ts `decodeAttentionForm` times both).
   * Recorded as `decodeAttention`.
   */
  decodeAttention?: DecodeAttentionForm | ((shape: ModelShape) => Promise<DecodeAttentionForm>)
  /**
   * Also write fixed-shape graphs per stage (`--static CTX[,CHUNK]`, for NPUs): a [1, chunk]
   * prefill and a [1, 1] decode graph over a KV buffer of contextLength slots, 'standard' ops.
   */
  static?: { contextLength: number, chunk?: number }
  /** Called as each layer is compiled (done of total, over all stages): long compiles say how far they are. */
  onProgress?: (done: number, total: number) => void
}

export async function compileShards (options: CompileOptions): Promise<ShardManifest> {
  const modelDir = resolve(options.modelDir)
  const outDir = resolve(options.outDir)
  const config = await readConfig(modelDir)
  const spec = normalizeConfig(config)
  const ranges = planStages(spec.shape.numLayers, {
    ...(options.stages !== undefined ? { stages: options.stages } : {}),
    ...(options.layers !== undefined ? { layers: options.layers } : {}),
  })
  const quant = quantizationOf(options, spec.shape.hiddenSize)
  const ops = OP_TABLES[options.opSet ?? DEFAULT_OP_SET]
  if (options.kernel !== undefined && (quant.kind !== 'int4' || quant.blockSize !== 32 || quant.activations !== 'int8' || ops.name !== 'ort-contrib' || options.static !== undefined)) {
    throw new CheckpointError(`kernel ${options.kernel}: int4 'ort-contrib' shards of block 32 with int8 activations, without static graphs, only`)
  }
  if (typeof options.decodeAttention === 'string' && ops.name !== 'ort-contrib') throw new CheckpointError(`decodeAttention ${options.decodeAttention}: only 'ort-contrib' graphs have the one-position attention it shapes`)
  const decodeAttention = ops.name !== 'ort-contrib'
    ? undefined
    : typeof options.decodeAttention === 'function' ? await options.decodeAttention(spec.shape) : options.decodeAttention ?? 'per-head'
  const staticShapes = options.static === undefined ? undefined : staticShapesOf(options.static, spec.shape.maxPositions)
  const weights = await openWeights(modelDir)
  const { shape } = spec
  const checked = async (name: string, dims: number[]): Promise<F32Tensor> => {
    const t = await weights.get(name)
    if (t.shape.length !== dims.length || t.shape.some((d, i) => d !== dims[i])) {
      throw new CheckpointError(`${name}: shape [${t.shape.join(', ')}], expected [${dims.join(', ')}]`)
    }
    return t
  }
  let layersDone = 0
  // Each static graph reads every layer again.
  const layersTotal = ranges.reduce((n, [a, b]) => n + b - a + 1, 0) * (staticShapes === undefined ? 1 : 3)
  const src: StageSource = {
    embed: async () => await checked(spec.mapping.embedName, [shape.vocabSize, shape.hiddenSize]),
    finalNorm: async () => await checked(spec.mapping.finalNormName, [shape.hiddenSize]),
    lmHead: async () => await checked(shape.tieWordEmbeddings || !weights.has(spec.mapping.lmHeadName) ? spec.mapping.embedName : spec.mapping.lmHeadName, [shape.vocabSize, shape.hiddenSize]),
    layer: async (l) => {
      const w = await spec.mapping.layer(weights, l)
      options.onProgress?.(++layersDone, layersTotal)
      const { hiddenSize: D, numHeads: H, numKvHeads: kvH, headDim: hd, intermediateSize: I } = shape
      const expect = (t: F32Tensor | undefined, dims: number[], what: string): void => {
        if (t !== undefined && (t.shape.length !== dims.length || t.shape.some((d, i) => d !== dims[i]))) {
          throw new CheckpointError(`layer ${l} ${what}: shape [${t.shape.join(', ')}], expected [${dims.join(', ')}]`)
        }
      }
      expect(w.qkv, [(H + 2 * kvH) * hd, D], 'qkv')
      expect(w.o, [D, H * hd], 'o_proj')
      const moe = shape.moe
      if (moe?.moeLayers.includes(l) === true) {
        if (w.moe === undefined) throw new CheckpointError(`layer ${l}: config makes it a mixture-of-experts layer but its router weight is missing`)
        if (w.moe.experts.length !== moe.numExperts) throw new CheckpointError(`layer ${l}: ${w.moe.experts.length} experts, config says ${moe.numExperts}`)
        expect(w.moe.router, [moe.numExperts, D], 'router')
        w.moe.experts.forEach((e, i) => {
          expect(e.gateUp, [2 * moe.expertIntermediateSize, D], `expert ${i} gate/up`)
          expect(e.down, [D, moe.expertIntermediateSize], `expert ${i} down_proj`)
        })
        if ((w.moe.shared !== undefined) !== (moe.sharedExpertIntermediateSize > 0)) throw new CheckpointError(`layer ${l}: shared expert weights and shared_expert_intermediate_size disagree`)
        if (w.moe.shared !== undefined) {
          expect(w.moe.shared.gateUp, [2 * moe.sharedExpertIntermediateSize, D], 'shared expert gate/up')
          expect(w.moe.shared.down, [D, moe.sharedExpertIntermediateSize], 'shared expert down_proj')
          expect(w.moe.shared.gate, [1, D], 'shared expert gate')
        }
      } else {
        if (w.moe !== undefined || w.gateUp === undefined || w.down === undefined) throw new CheckpointError(`layer ${l}: expected a dense MLP`)
        expect(w.gateUp, [2 * I, D], 'gate/up')
        expect(w.down, [D, I], 'down_proj')
      }
      if (spec.extras.qkvBias && w.qkvBias === undefined) throw new CheckpointError(`layer ${l}: q/k/v bias missing`)
      return w
    },
  }

  await mkdir(outDir, { recursive: true })
  const stages: StageManifest[] = []
  for (const [index, layers] of ranges.entries()) {
    const dir = `stage-${index}`
    await mkdir(join(outDir, dir), { recursive: true })
    const hasEmbedding = index === 0
    const hasHead = index === ranges.length - 1
    const g = await buildStage(src, {
      spec, layers, hasEmbedding, hasHead, ops, quant, accuracyLevel: options.accuracyLevel ?? 4, dataFile: STAGE_DATA_FILE,
      ...(decodeAttention === undefined ? {} : { decodeAttention }),
    })
    const graphPath = join(outDir, dir, STAGE_GRAPH_FILE)
    const dataPath = join(outDir, dir, STAGE_DATA_FILE)
    const doc = `layers ${layers[0]}-${layers[1]} of ${basename(modelDir)}`
    await writeGraph(g, graphPath, `shoal-stage-${index}`, doc, dataPath)
    const files = [await describeFile(outDir, graphPath), await describeFile(outDir, dataPath)]
    const stage: StageManifest = { index, layers, hasEmbedding, hasHead, dir, graph: `${dir}/${STAGE_GRAPH_FILE}`, files }
    if (ops.name === 'ort-contrib') {
      const decodePath = join(outDir, dir, STAGE_DECODE_GRAPH_FILE)
      await writeFile(decodePath, g.encode(`shoal-stage-${index}-decode`, `${doc}, one-position steps over a past`, inlineDecodeBranches))
      files.push(await describeFile(outDir, decodePath))
      stage.decodeGraph = `${dir}/${STAGE_DECODE_GRAPH_FILE}`
    }
    if (staticShapes !== undefined) {
      const common = { spec, layers, hasEmbedding, hasHead, quant, accuracyLevel: options.accuracyLevel ?? 4, dataFile: STATIC_DATA_FILE, contextLength: staticShapes.contextLength }
      const prefillPath = join(outDir, dir, STATIC_PREFILL_FILE)
      const decodePath = join(outDir, dir, STATIC_DECODE_FILE)
      const staticData = join(outDir, dir, STATIC_DATA_FILE)
      const prefill = await buildStaticStage(src, { ...common, steps: staticShapes.chunk })
      await writeGraph(prefill, prefillPath, `shoal-stage-${index}-static-prefill`, `${doc}, static [1, ${staticShapes.chunk}] over ${staticShapes.contextLength} KV slots`, staticData)
      const decode = await buildStaticStage(src, { ...common, steps: 1 })
      // The decode graph points into the prefill graph's weights file: it must have laid out the same bytes.
      if (!sameData(prefill, decode)) throw new Error(`stage ${index}: static prefill and decode graphs disagree on their weights`)
      await writeGraph(decode, decodePath, `shoal-stage-${index}-static-decode`, `${doc}, static [1, 1] over ${staticShapes.contextLength} KV slots`)
      files.push(await describeFile(outDir, prefillPath), await describeFile(outDir, decodePath), await describeFile(outDir, staticData))
      stage.static = { prefill: `${dir}/${STATIC_PREFILL_FILE}`, decode: `${dir}/${STATIC_DECODE_FILE}` }
    }
    stages.push(stage)
  }

  const tokenizerFiles = []
  for (const f of TOKENIZER_FILES) {
    if (!existsSync(join(modelDir, f))) continue
    await copyFile(join(modelDir, f), join(outDir, f))
    tokenizerFiles.push(await describeFile(outDir, join(outDir, f)))
  }
  if (!tokenizerFiles.some(f => f.path === 'tokenizer.json')) throw new CheckpointError(`${modelDir}: no tokenizer.json`)

  const description = typeof config.shoal_description === 'string' ? config.shoal_description : undefined
  const manifest: ShardManifest = {
    format: MANIFEST_FORMAT,
    modelId: options.modelId ?? (typeof config.shoal_model_id === 'string' ? config.shoal_model_id : basename(modelDir)),
    sourceHash: await checkpointHash(modelDir),
    shape,
    quantization: quant,
    opSet: ops.name,
    generation: await readGenerationDefaults(modelDir, config),
    tokenizerFiles,
    stages,
    ...(description !== undefined ? { description } : {}),
    compilerVersion: COMPILER_VERSION,
    batchPadding: ops.batchPadding,
    batchedPrefillWithPast: ops.batchedPrefillWithPast,
    ...(decodeAttention === undefined ? {} : { decodeAttention }),
    ...(staticShapes !== undefined ? { static: staticShapes } : {}),
  }
  await writeManifest(outDir, manifest)
  return manifest
}

/** Writes a graph, and its external weights when `dataPath` is given. */
async function writeGraph (g: GraphBuilder, graphPath: string, name: string, doc: string, dataPath?: string): Promise<void> {
  await writeFile(graphPath, g.encode(name, doc))
  if (dataPath === undefined) return
  const fh = await open(dataPath, 'w')
  try {
    for (const chunk of g.data()) await fh.write(chunk)
  } finally {
    await fh.close()
  }
}

function sameData (a: GraphBuilder, b: GraphBuilder): boolean {
  if (a.dataSize !== b.dataSize) return false
  const hash = (g: GraphBuilder): string => {
    const h = createHash('sha256')
    for (const c of g.data()) h.update(c)
    return h.digest('hex')
  }
  return hash(a) === hash(b)
}

/** Checks `--static CTX[,CHUNK]` against the model: CTX within its context limit, CHUNK within CTX. */
export function staticShapesOf (o: { contextLength: number, chunk?: number }, maxPositions: number): StaticShapes {
  const ctx = o.contextLength
  if (!Number.isSafeInteger(ctx) || ctx < 2) throw new CheckpointError(`static context length must be an integer ≥ 2, got ${ctx}`)
  if (ctx > maxPositions) throw new CheckpointError(`static context length ${ctx} exceeds the model's context limit ${maxPositions}`)
  const chunk = o.chunk ?? Math.min(DEFAULT_STATIC_CHUNK, ctx)
  if (!Number.isSafeInteger(chunk) || chunk < 1 || chunk > ctx) throw new CheckpointError(`static prefill chunk must be an integer in 1..${ctx}, got ${chunk}`)
  return { contextLength: ctx, chunk, opSet: 'standard' }
}
