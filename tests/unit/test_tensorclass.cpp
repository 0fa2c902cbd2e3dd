// Unit tests of tensorclass: the declaration macro, field accessors and setters, the registry,
// rebuilding a type from a tensordict and the typed operations.

#include <tdshm/tensorclass.h>

#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace tdshm_test {

TDSHM_TENSORCLASS(TestTransition, "tdshm.test.Transition", obs, action, reward);
TDSHM_TENSORCLASS(TestOther, "tdshm.test.Other", x);
TDSHM_TENSORCLASS(TestTwin, "tdshm.test.Twin", obs, action, reward);  // TestTransition's fields

}  // namespace tdshm_test

namespace {

using tdshm::Key;
using tdshm::KeyError;
using tdshm::ShapeError;
using tdshm::TensorClassBase;
using tdshm::TensorDict;
using tdshm::TypeError;
using tdshm_test::TestOther;
using tdshm_test::TestTransition;
using tdshm_test::TestTwin;

using Shape = std::vector<int64_t>;

constexpr const char* kName = "tdshm.test.Transition";

TestTransition make_transition() {
  return TestTransition({{"obs", at::randn({4, 3})}, {"action", at::ones({4})}}, {4});
}

std::shared_ptr<TensorClassBase> transition_factory(const TensorDict& td) {
  return std::make_shared<TestTransition>(td);
}

// ---------------------------------------------------------------------------------------------
// Registration

TEST(TensorClassRegistry, DeclarationRegistersAutomatically) {
  EXPECT_TRUE(tdshm_test::tdshm_registered_TestTransition);
  EXPECT_TRUE(tdshm_test::tdshm_registered_TestOther);
  EXPECT_TRUE(tdshm::is_tensorclass_registered(kName));
  EXPECT_TRUE(tdshm::is_tensorclass_registered("tdshm.test.Other"));
  EXPECT_FALSE(tdshm::is_tensorclass_registered("tdshm.test.NeverDeclared"));
  EXPECT_FALSE(tdshm::is_tensorclass_registered(""));
}

TEST(TensorClassRegistry, FieldsInDeclarationOrder) {
  EXPECT_EQ(tdshm::tensorclass_fields(kName), (std::vector<std::string>{"obs", "action", "reward"}));
  EXPECT_EQ(tdshm::tensorclass_fields("tdshm.test.Other"), (std::vector<std::string>{"x"}));
  EXPECT_EQ(TestTransition::kTypeName, kName);
  ASSERT_EQ(TestTransition::kFields.size(), 3u);
  EXPECT_EQ(TestTransition::kFields[0], "obs");
  EXPECT_EQ(TestTransition::kFields[2], "reward");
}

TEST(TensorClassRegistry, FieldsOfAnUnknownNameIsATypeError) {
  EXPECT_THROW(static_cast<void>(tdshm::tensorclass_fields("tdshm.test.NeverDeclared")), TypeError);
}

TEST(TensorClassRegistry, ReRegisteringWithOtherFieldsIsATypeError) {
  EXPECT_THROW(tdshm::register_tensorclass(kName, {"obs"}, transition_factory), TypeError);
  EXPECT_THROW(tdshm::register_tensorclass(kName, {"obs", "action", "reward", "extra"}, transition_factory),
               TypeError);
  EXPECT_THROW(tdshm::register_tensorclass(kName, {"action", "obs", "reward"}, transition_factory), TypeError);
  EXPECT_EQ(tdshm::tensorclass_fields(kName), (std::vector<std::string>{"obs", "action", "reward"}));
}

TEST(TensorClassRegistry, ReRegisteringWithTheSameFieldsIsANoOp) {
  EXPECT_NO_THROW(tdshm::register_tensorclass(kName, {"obs", "action", "reward"}, transition_factory));
  EXPECT_NO_THROW(TestTransition::register_type());
  EXPECT_EQ(tdshm::tensorclass_fields(kName), (std::vector<std::string>{"obs", "action", "reward"}));
  auto obj = tdshm::make_tensorclass(make_transition().tensordict());
  EXPECT_NE(dynamic_cast<TestTransition*>(obj.get()), nullptr);
}

TEST(TensorClassRegistry, InvalidRegistrationIsATypeError) {
  EXPECT_THROW(tdshm::register_tensorclass("", {"a"}, transition_factory), TypeError);
  EXPECT_THROW(tdshm::register_tensorclass("tdshm.test.NoFactory", {"a"}, tdshm::TensorClassFactory{}), TypeError);
  EXPECT_FALSE(tdshm::is_tensorclass_registered("tdshm.test.NoFactory"));
}

// ---------------------------------------------------------------------------------------------
// Objects, accessors and setters

TEST(TensorClassObject, ConstructionFromItems) {
  at::Tensor obs = at::randn({4, 3});
  TestTransition tr({{"obs", obs}, {"action", at::ones({4})}}, {4});
  EXPECT_EQ(tr.batch_size(), (Shape{4}));
  EXPECT_EQ(tr.type_name(), kName);
  EXPECT_EQ(tr.tensordict().class_name(), kName);
  EXPECT_EQ(tr.tensordict().batch_size(), (Shape{4}));
  EXPECT_TRUE(at::equal(tr.obs(), obs));
  EXPECT_EQ(tr.obs().data_ptr(), obs.data_ptr());
  EXPECT_TRUE(at::equal(tr.action(), at::ones({4})));
  EXPECT_EQ(tr.tensordict().keys(), (std::vector<Key>{"obs", "action"}));
}

TEST(TensorClassObject, ConstructionChecksTheBatchSize) {
  EXPECT_THROW(TestTransition({{"obs", at::zeros({3, 3})}}, {4}), ShapeError);
}

TEST(TensorClassObject, ConstructionWithADevice) {
  TestTransition tr({{"obs", at::zeros({4, 3})}}, {4}, c10::Device(at::kCPU));
  ASSERT_TRUE(tr.tensordict().device().has_value());
  EXPECT_EQ(*tr.tensordict().device(), c10::Device(at::kCPU));
}

TEST(TensorClassObject, UnknownKeyIsAKeyError) {
  EXPECT_THROW(TestTransition({{"obs", at::zeros({4, 3})}, {"not_a_field", at::zeros({4})}}, {4}), KeyError);
  TensorDict td({{"obs", at::zeros({4, 3})}, {"nope", at::zeros({4})}}, {4});
  EXPECT_THROW(static_cast<void>(TestTransition(td)), KeyError);
  EXPECT_THROW(static_cast<void>(tdshm::tensorclass_cast<TestTransition>(
                   TensorDict({{"nope", at::zeros({4})}}, {4}).set_class_name(kName))),
               KeyError);
}

TEST(TensorClassObject, AbsentFieldIsAKeyError) {
  TestTransition tr = make_transition();
  EXPECT_THROW(static_cast<void>(tr.reward()), KeyError);
  EXPECT_THROW(static_cast<void>(tr.get_value("reward")), KeyError);
  TestTransition empty({}, {4});
  EXPECT_THROW(static_cast<void>(empty.obs()), KeyError);
  EXPECT_TRUE(empty.tensordict().empty());
}

TEST(TensorClassObject, GetValueOfANonFieldIsAKeyError) {
  TestTransition tr = make_transition();
  EXPECT_THROW(static_cast<void>(tr.get_value("not_a_field")), KeyError);
  EXPECT_TRUE(tr.get_value("obs").is_tensor());
  EXPECT_TRUE(tr.get_value("obs").tensor().is_same(tr.obs()));
}

TEST(TensorClassObject, SettersSetFields) {
  TestTransition tr = make_transition();
  at::Tensor reward = at::full({4}, 2.0);
  TestTransition& ret = tr.set_reward(reward);
  EXPECT_EQ(&ret, &tr);
  EXPECT_TRUE(at::equal(tr.reward(), reward));
  tr.set_obs(at::zeros({4, 5})).set_action(at::zeros({4, 2}));
  EXPECT_EQ(tr.obs().sizes(), (Shape{4, 5}));
  EXPECT_EQ(tr.action().sizes(), (Shape{4, 2}));
  EXPECT_EQ(tr.tensordict().keys(), (std::vector<Key>{"obs", "action", "reward"}));
}

TEST(TensorClassObject, SetterValidatesTheBatchSize) {
  TestTransition tr = make_transition();
  at::Tensor obs = tr.obs().clone();
  EXPECT_THROW(tr.set_reward(at::zeros({3})), ShapeError);
  EXPECT_FALSE(tr.tensordict().contains("reward"));
  EXPECT_THROW(tr.set_obs(at::zeros({5, 3})), ShapeError);
  EXPECT_TRUE(at::equal(tr.obs(), obs));
  EXPECT_THROW(tr.set_obs(TensorDict(Shape{3})), ShapeError);
  EXPECT_TRUE(at::equal(tr.obs(), obs));
}

TEST(TensorClassObject, FieldsMayHoldTensorDictsAndNonTensors) {
  TestTransition tr = make_transition();
  tr.set_reward("sparse");
  tr.set_obs(TensorDict({{"pixels", at::zeros({4, 8})}}, {4}));
  ASSERT_TRUE(tr.get_value("reward").is_non_tensor());
  EXPECT_EQ(std::get<std::string>(tr.get_value("reward").non_tensor()), "sparse");
  ASSERT_TRUE(tr.get_value("obs").is_tensordict());
  EXPECT_EQ(tr.tensordict().get({"obs", "pixels"}).sizes(), (Shape{4, 8}));
  // The accessor returns a tensor: another kind is a TypeError.
  EXPECT_THROW(static_cast<void>(tr.reward()), TypeError);
  EXPECT_THROW(static_cast<void>(tr.obs()), TypeError);
}

TEST(TensorClassObject, TensorDictIsAHandle) {
  TestTransition tr = make_transition();
  TensorDict body = tr.tensordict();
  body.set("reward", at::ones({4}));
  EXPECT_TRUE(at::equal(tr.reward(), at::ones({4})));
  TestTransition copy = tr;
  copy.set_reward(at::zeros({4}));
  EXPECT_TRUE(at::equal(tr.reward(), at::zeros({4})));
}

TEST(TensorClassObject, ConstructionFromATensorDictSharesLeavesAndLeavesItPlain) {
  TensorDict td({{"obs", at::zeros({4, 3})}, {"action", at::ones({4})}}, {4});
  TestTransition tr(td);
  EXPECT_EQ(tr.type_name(), kName);
  EXPECT_TRUE(td.class_name().empty());
  EXPECT_EQ(tr.obs().data_ptr(), td.get("obs").data_ptr());
  td.get("obs").fill_(3);
  EXPECT_TRUE(at::equal(tr.obs(), at::full({4, 3}, 3.0)));
}

TEST(TensorClassObject, ToTensorDictIsPlainAndSharesLeaves) {
  TestTransition tr = make_transition();
  TensorDict plain = tr.to_tensordict();
  EXPECT_TRUE(plain.class_name().empty());
  EXPECT_EQ(tr.type_name(), kName);  // the object keeps its type
  EXPECT_EQ(tr.tensordict().class_name(), kName);
  EXPECT_EQ(plain.batch_size(), tr.batch_size());
  EXPECT_EQ(plain.keys(), tr.tensordict().keys());
  EXPECT_EQ(plain.get("obs").data_ptr(), tr.obs().data_ptr());
  EXPECT_EQ(plain.get("action").data_ptr(), tr.action().data_ptr());
  plain.get("action").fill_(9);
  EXPECT_TRUE(at::equal(tr.action(), at::full({4}, 9.0)));
  EXPECT_THROW(static_cast<void>(tdshm::make_tensorclass(plain)), TypeError);
}

// ---------------------------------------------------------------------------------------------
// Rebuilding the type from a tensordict

TEST(TensorClassMake, RebuildsTheRegisteredType) {
  TestTransition tr = make_transition();
  std::shared_ptr<TensorClassBase> obj = tdshm::make_tensorclass(tr.tensordict());
  ASSERT_NE(obj, nullptr);
  EXPECT_EQ(obj->type_name(), kName);
  EXPECT_EQ(obj->batch_size(), (Shape{4}));
  auto* typed = dynamic_cast<TestTransition*>(obj.get());
  ASSERT_NE(typed, nullptr);
  EXPECT_EQ(typed->obs().data_ptr(), tr.obs().data_ptr());
  EXPECT_EQ(dynamic_cast<TestOther*>(obj.get()), nullptr);
  EXPECT_TRUE(obj->get_value("action").tensor().is_same(tr.action()));
}

TEST(TensorClassMake, FromANamedPlainTensorDict) {
  TensorDict td({{"x", at::arange(3)}}, {3});
  td.set_class_name("tdshm.test.Other");
  auto obj = tdshm::make_tensorclass(td);
  auto* other = dynamic_cast<TestOther*>(obj.get());
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(at::equal(other->x(), at::arange(3)));
}

TEST(TensorClassMake, PlainOrUnregisteredIsATypeError) {
  TensorDict plain({{"obs", at::zeros({4, 3})}}, {4});
  EXPECT_THROW(static_cast<void>(tdshm::make_tensorclass(plain)), TypeError);
  plain.set_class_name("nope");
  EXPECT_THROW(static_cast<void>(tdshm::make_tensorclass(plain)), TypeError);
}

TEST(TensorClassMake, KeysThatAreNotFieldsAreAKeyError) {
  TensorDict td({{"obs", at::zeros({4, 3})}, {"x", at::zeros({4})}}, {4});
  td.set_class_name(kName);
  EXPECT_THROW(static_cast<void>(tdshm::make_tensorclass(td)), KeyError);
}

TEST(TensorClassCast, ToTheRightType) {
  TestTransition tr = make_transition();
  TestTransition back = tdshm::tensorclass_cast<TestTransition>(tr.tensordict());
  EXPECT_EQ(back.type_name(), kName);
  EXPECT_EQ(back.obs().data_ptr(), tr.obs().data_ptr());
}

TEST(TensorClassCast, ToTheWrongTypeIsATypeError) {
  TestTransition tr = make_transition();
  EXPECT_THROW(static_cast<void>(tdshm::tensorclass_cast<TestOther>(tr.tensordict())), TypeError);
  EXPECT_THROW(static_cast<void>(tdshm::tensorclass_cast<TestTransition>(tr.to_tensordict())), TypeError);
  TensorDict other({{"x", at::zeros({4})}}, {4});
  other.set_class_name("tdshm.test.Other");
  EXPECT_THROW(static_cast<void>(tdshm::tensorclass_cast<TestTransition>(other)), TypeError);
}

// ---------------------------------------------------------------------------------------------
// Typed operations keep the type

TEST(TensorClassOps, CloneKeepsTheTypeAndCopies) {
  TestTransition tr = make_transition();
  TestTransition cl = tr.clone();
  EXPECT_EQ(cl.type_name(), kName);
  EXPECT_EQ(cl.batch_size(), tr.batch_size());
  EXPECT_NE(cl.obs().data_ptr(), tr.obs().data_ptr());
  EXPECT_TRUE(at::equal(cl.obs(), tr.obs()));
  at::Tensor before = tr.obs().clone();
  cl.obs().zero_();
  cl.set_reward(at::zeros({4}));
  EXPECT_TRUE(at::equal(tr.obs(), before));
  EXPECT_FALSE(tr.tensordict().contains("reward"));
}

TEST(TensorClassOps, ExpandKeepsTheType) {
  TestTransition tr = make_transition();
  TestTransition ex = tr.expand({2, 4});
  EXPECT_EQ(ex.type_name(), kName);
  EXPECT_EQ(ex.batch_size(), (Shape{2, 4}));
  EXPECT_EQ(ex.obs().sizes(), (Shape{2, 4, 3}));
  EXPECT_EQ(ex.action().sizes(), (Shape{2, 4}));
  EXPECT_THROW(static_cast<void>(tr.expand({3})), ShapeError);
}

TEST(TensorClassOps, ContiguousAndToKeepTheType) {
  TestTransition tr = make_transition();
  TestTransition cont = tr.expand({2, 4}).contiguous();
  EXPECT_EQ(cont.type_name(), kName);
  EXPECT_TRUE(cont.obs().is_contiguous());
  TestTransition cpu = tr.to(at::kCPU);
  EXPECT_EQ(cpu.type_name(), kName);
  ASSERT_TRUE(cpu.tensordict().device().has_value());
  EXPECT_EQ(*cpu.tensordict().device(), c10::Device(at::kCPU));
}

TEST(TensorClassOps, UpdateInPlace) {
  TestTransition tr = make_transition();
  const void* ptr = tr.obs().data_ptr();
  TestTransition& ret = tr.update_(TensorDict({{"obs", at::full({4, 3}, 5.0)}}, {4}));
  EXPECT_EQ(&ret, &tr);
  EXPECT_EQ(tr.obs().data_ptr(), ptr);
  EXPECT_TRUE(at::equal(tr.obs(), at::full({4, 3}, 5.0)));
  at::Tensor before = tr.obs().clone();
  EXPECT_THROW(tr.update_(TensorDict({{"obs", at::zeros({4, 3})}, {"reward", at::zeros({4})}}, {4})), KeyError);
  EXPECT_TRUE(at::equal(tr.obs(), before));
}

// ---------------------------------------------------------------------------------------------
// Consolidation: the class name is part of the schema fingerprint

// Two tensorclasses with the same fields, and a plain tensordict with the same leaves, consolidate
// to the same bytes but not to the same schema: a consolidated transfer between them is refused.
TEST(TensorClassConsolidate, FingerprintNamesTheClass) {
  const TestTransition tr({{"obs", at::zeros({4, 3})}, {"action", at::ones({4})}}, {4});
  const TestTwin twin({{"obs", at::zeros({4, 3})}, {"action", at::ones({4})}}, {4});
  const TensorDict plain({{"obs", at::zeros({4, 3})}, {"action", at::ones({4})}}, {4});
  const uint64_t fp_tr = tr.consolidate().tensordict().schema_fingerprint();
  const uint64_t fp_twin = twin.consolidate().tensordict().schema_fingerprint();
  const uint64_t fp_plain = plain.consolidate().schema_fingerprint();
  EXPECT_NE(fp_tr, fp_twin);
  EXPECT_NE(fp_tr, fp_plain);
  EXPECT_NE(fp_twin, fp_plain);
  EXPECT_EQ(tr.consolidate().tensordict().consolidated_storage().numel(), plain.consolidate().consolidated_storage().numel());
  // The same class and fields: equal, whatever the values.
  EXPECT_EQ(fp_tr, TestTransition({{"obs", at::ones({4, 3})}, {"action", at::zeros({4})}}, {4})
                       .consolidate()
                       .tensordict()
                       .schema_fingerprint());
}

}  // namespace
