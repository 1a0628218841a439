/**
 * Speculative decoding: a cheap drafter proposes K tokens, the target checks all of them in one
 * step of K + 1 positions, and the accepted prefix plus the target's own next token come out —
 * token for token what the target alone would produce (greedy by id; with temperature, speculative
 * sampling that keeps the target's distribution exactly).
 *  - drafters behind one interface: prompt lookup (n-gram match, no model) and a draft model;
 *  - acceptance (pure), adaptive K (pure, from measured acceptance and costs);
 *  - the speculative token source the decode loop runs over, with rollback of rejected positions
 *    by KV length.
 */
export { promptLookup } from './prompt-lookup.ts'
export type { PromptLookupOptions } from './prompt-lookup.ts'
export { acceptGreedy, acceptSampled, distribution, residual, sampleFrom } from './acceptance.ts'
export type { Acceptance } from './acceptance.ts'
export { chooseK, createCostTracker, expectedTokens, PLAIN_WINDOW, plainTokenMs, tokensPerMs } from './adaptive-k.ts'
export type { CostPriors, CostTracker, SpeculationCosts } from './adaptive-k.ts'
export { createPromptLookupDrafter } from './drafter.ts'
export type { Drafter, DraftRequest, Proposal, SequenceDrafter } from './drafter.ts'
export { createSpeculativeSource } from './source.ts'
export type { SpeculationCounts, SpeculationEvents, SpeculationOptions, SpeculativeSource, SpeculativeSourceInit, TargetSequence, Verifier } from './source.ts'
export { draftModelDrafter } from './draft-model.ts'
export type { DraftModel, DraftModelInit, DraftSteps } from './draft-model.ts'
export { createSpeculation } from './speculation.ts'
export { DEFAULT_LOOKUP_MIN_NGRAM, DEFAULT_LOOKUP_NAME, defaultLookupMinNgram, defaultLookupSkipped, defaultLookupTakes, useDefaultLookup } from './default.ts'
export type { ModelFacts } from './default.ts'
export { exactVerifyNeeds, inexactTarget } from './exact.ts'
export type { ChainTarget, Speculation, SpeculationInit } from './speculation.ts'
export type { SpeculationMetrics } from './metrics.ts'
