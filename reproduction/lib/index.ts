/** What the benchmark scripts share: summaries, deterministic prompts, the machine's header lines, shoal child daemons, the SSE reader. */
export { floorRank, lowerMedian, mean, median, nearestRank, upperMedian, upperMedianBy } from './stats.ts'
export { lcgTokens, promptIds, raggedPromptIds, streamPromptIds } from './prompts.ts'
export { formatLoad, gitDescribe, loadAverage, lscpuModel } from './machine.ts'
export { createShoalProcesses, SHOAL_BIN } from './processes.ts'
export type { ShoalProcesses } from './processes.ts'
export { sseEvents, tokenChunks } from './sse.ts'
export type { TokenChunk } from './sse.ts'
