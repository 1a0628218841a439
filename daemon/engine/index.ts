/**
 * The engine: runs ONNX stage graphs in worker threads and generates text with them.
 *  - backends (onnxruntime-node always; openvino-node when installed) behind one small interface;
 *  - the stage engine (open / step / free a sequence; KV stays in the worker) that the local
 *    service, pipeline stages and the micro-batcher build on;
 *  - sampling (pure functions) and the decode loop;
 *  - batched steps (`stepBatch`: several sequences in one run, left-padded KV) and the
 *    micro-batcher executor over them (`createBatchedExecutor`);
 *  - static graphs (`shoal shard --static`) for devices that need fixed shapes (NPU): which graphs a
 *    stage runs (graph-choice.ts) and a runner over the static pair (static-runner.ts);
 *  - the local InferenceService for a whole-model shard directory, with sequence admission that
 *    queues within a wait budget (`decideAdmission`, pure).
 */
export { createLocalService } from './local-service.ts'
export { decideAdmission, expectedSlotWaitMs, ownWaitBudget } from './admission.ts'
export type { AdmissionDecision, AdmissionPolicy, SlotState } from './admission.ts'
export { createSlots, waitTurn } from './slots.ts'
export type { Turn } from './slots.ts'
export type { EngineHostOptions, LocalService, LocalServiceInit, LocalServiceLoad, LocalServiceStats, PrefixSummary, TokenSourceWrapper, WrapContext } from './local-service.ts'
export { createBatchedExecutor } from './batched-executor.ts'
export { createStageEngine, abortReason } from './stage-engine.ts'
export type {
  BatchingStageEngine, PrefixKeepingEngine, StageBatchItem, StageBatchResult, StageEngine, StageEngineInit, StageStepInput,
  StepOptions,
} from './stage-engine.ts'
export { createStageRunner, DEFAULT_MAX_SEQUENCES } from './stage-runner.ts'
export type { PrefixKeepingRunner, StageRunner, StageRunnerInit } from './stage-runner.ts'
export { createStaticStageRunner } from './static-runner.ts'
export type { StaticStageRunnerInit, StaticShapesInit } from './static-runner.ts'
export { chooseStageGraphs, needsStaticShapes, resolveGraphChoice, stageInfoFor, stageInfoOf } from './graph-choice.ts'
export type { GraphChoice, GraphMode, StaticGraphChoice } from './graph-choice.ts'
export { ENGINE_PROTOCOL_VERSION, int64Of } from './protocol.ts'
export type { StageInfo, StepOutput } from './protocol.ts'
export { generateSequence, endConditions, RUN_AHEAD_STEPS } from './generate.ts'
export { runsAheadAfter } from './run-ahead.ts'
export type { GenerationInput, TokenSource } from './generate.ts'
export { createGenerationService, updatePrefillRate } from './generation-service.ts'
export type { GenerationHost, GenerationService, RequestRun, RequestTicket, RunningModel } from './generation-service.ts'
export { argmax, createRng, GREEDY_PICK, inverseCdf, nextPick, nucleus, pickToken, sampleToken } from './sampling.ts'
export { greedyVerdict } from './verdict.ts'
export type { Rng, SamplerParams, TokenPick } from './sampling.ts'
export { loadBackend, BACKEND_NAMES } from './backend/index.ts'
export { createOnnxruntimeBackend } from './backend/onnxruntime.ts'
export { compileConfig as openvinoCompileConfig } from './backend/openvino.ts'
export { compiledCacheDir, openvinoCacheDir } from './backend/types.ts'
export type { Backend, BackendName, BackendSession, HostTensor, LoadOptions, TensorMap } from './backend/types.ts'
export { DeadlineError, EngineError, ModelNotFoundError, OverloadedError, ShuttingDownError } from './errors.ts'
export { admitPrompt, checkCompletionFits, requestScope } from './request-scope.ts'
export type { RequestScope } from './request-scope.ts'
export { createOffThreadSessions } from './off-thread-sessions.ts'
export type { OffThreadSession, OffThreadSessions } from './off-thread-sessions.ts'
export { int4KernelName, prepareNativeKernels } from './native/kernels.ts'
export type { NativeKernels } from './native/kernels.ts'
export { attentionKernelApplies, int4KernelApplies, int4ProductsTakeKernel, kernelsApplying, swapKernels } from './native/swap.ts'
export { greedyHeadExact } from './native/head-check.ts'
export { f32ProductsExact } from './native/f32-check.ts'
export { f32KernelFits } from './native/build.ts'
export { chooseDecodeAttention, decodeAttentionForm, decodeAttentionOrPerHead, int4BatchingVerdict, matMulNBitsRowInvariance } from './kernel-probe.ts'
export type { DecodeAttentionChoice, RowInvariance } from './kernel-probe.ts'
