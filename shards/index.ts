/**
 * shards: turning Hugging Face checkpoints into per-stage ONNX shards the engine runs.
 * Import (config normalisation through an architecture registry, safetensors in F32/F16/BF16),
 * the shard compiler (one graph + one external-data file per stage, manifest with sha256s),
 * manifest loading/verification, the random-weight test/demo checkpoint generator, and the
 * compile cache used by `shoal serve DIR`.
 */
export * from './contract.ts'
export { compileShards, COMPILER_VERSION, type CompileOptions } from './compile.ts'
export { loadManifest, validateManifest, verifyShardFiles, manifestHash } from './manifest.ts'
export { normalizeConfig, supportedArchitectures, type ModelSpec, type ArchExtras } from './architectures.ts'
export { planStages, parseLayerRanges } from './split.ts'
export { invFreqAt, rotaryOf, SUPPORTED_ROPE_TYPES, type Rotary, type RopeSpec } from './rope.ts'
export {
  compileExpertShards, EXPERT_SHARDS_FORMAT, MOE_BASE, MOE_INPUT, MOE_EXPERTS, MOE_WEIGHTS, type ExpertShardLayout, type ExpertShardOptions,
} from './expert-shards.ts'
export { copyTaskPrompt, generateDraftPair, generateTestModel, successorCycle, type CopyTaskOptions, TEST_ARCHITECTURES, MOE_TEST_ARCHITECTURES, type DraftPairOptions, type GenerateOptions, type TestArchitecture, type MoeTestArchitecture, type TestModelSize } from './testmodel/generate.ts'
export { createProgress } from './progress.ts'
export type { ProgressOptions } from './progress.ts'
export { ensureDemoModel, compileCached, isShardDir, DEMO_MODEL_ID, type DemoOptions, type CompileCacheProgress } from './cache.ts'
export {
  UnsupportedArchitectureError, CheckpointError, LayerSplitError, ManifestError, ShardIntegrityError,
} from './errors.ts'
