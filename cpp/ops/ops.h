// Every op of the core, one header per family.
#pragma once
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/cast.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/norm.h"
#include "ops/paged_attention.h"
#include "ops/rope.h"
#include "ops/softmax.h"
#include "ops/topk.h"
